"""The BSP engine loop: one call walks a program's phases with the GIL released, running compute phases'
instruction rows (see _codelets) and exchange phases' copy rows and compact rows (see _exchange), shared by a thread team
(see _team.pxd). Phase kinds and row layouts are the names _opcodes.py declares."""

from libc.stdlib cimport free, malloc
from libc.string cimport memset

from popsim._arena cimport TileArena
from popsim._codelets cimport TRAPPED, run_instruction
from popsim._exchange cimport copy_run, copy_single, prefetch_run, prefetch_single, ps_prefetch_read, stream_copy
from popsim._opcodes_enums cimport *
from popsim._team cimport (ps_add, ps_claim, ps_close, ps_load, ps_quit, ps_relax, ps_quitting, ps_release,
                           ps_set_once, ps_store, ps_team, pthread_create, pthread_detach, pthread_t)
from popsim._types cimport byte_t, copy_t, offset_t

include "_opcodes_report.pxi"

# Host threads one run may use: more only contend for the ticket, and each costs a thread stack.
MAX_THREADS = 64


# One run's arrays as raw pointers, shared by the team's threads. Rows are NCOLS wide (instructions),
# COPY_COLS (copies), RUN_COLS (runs), PHASE_COLS (phases), SR_COLS (stream rows) and ST_COLS (streams).
cdef struct Engine:
    byte_t* base
    byte_t* host
    const offset_t* phases
    Py_ssize_t num_phases
    const offset_t* phase_cycles
    const offset_t* instructions
    const double* fparams
    const copy_t* copies
    const copy_t* runs
    offset_t* counters
    const offset_t* stream_rows
    offset_t* streams
    Py_ssize_t start  # the phase the run starts at (after a host call, the one following it)
    long long trap  # the first instruction row that trapped, else -1
    ps_team team
    long long refs  # threads still using this struct: the last to leave frees it


# Rows claimed at a time. Claims of a few rows made the threads fight over the ticket's cache line (the CNN
# step ran 15-20% slower with 4 vertices / 64 exchange rows per claim); these still split a phase of a few
# hundred vertices or a few thousand rows between two threads.
DEF COMPUTE_CHUNK = 16
DEF EXCHANGE_CHUNK = 256
# An exchange row's first source and destination lines are fetched this many rows ahead: the rows' sources
# are scattered over the tiles' memory, and the copy would otherwise wait on each miss in turn.
DEF PREFETCH_ROWS = 16
# Likewise the first lines of a vertex's two inputs, this many vertices ahead.
DEF PREFETCH_VERTICES = 2
DEF PREFETCH_LINES = 8
DEF LINE_BYTES = 64


cdef inline void prefetch_operands(byte_t* base, const offset_t* row) noexcept nogil:
    """Ask for the first lines of a vertex's a and b operands (a hint: a column a kind leaves unused only
    names some address, and a prefetch never faults)."""
    cdef int k
    for k in range(PREFETCH_LINES):
        ps_prefetch_read(base + row[C_A] + k * LINE_BYTES)
        ps_prefetch_read(base + row[C_B] + k * LINE_BYTES)


cdef inline Py_ssize_t run_rows(Engine* e, Py_ssize_t kind, Py_ssize_t start, Py_ssize_t stop,
                                offset_t itemsize) noexcept nogil:
    """Rows start..stop-1 of a COMPUTE, EXCHANGE or RUNS phase (``itemsize``: a RUNS phase's element size);
    returns the compute rows' out-of-range dynamic indices."""
    cdef Py_ssize_t i, r, bad = 0
    if kind == PH_COMPUTE:
        for i in range(start, stop):
            if i + PREFETCH_VERTICES < stop:
                prefetch_operands(e.base, e.instructions + (i + PREFETCH_VERTICES) * NCOLS)
            r = run_instruction(e.base, e.instructions + i * NCOLS, e.fparams[i], e.instructions)
            if r == TRAPPED:
                ps_set_once(&e.trap, i)
            else:
                bad += r
    elif kind == PH_EXCHANGE:
        for i in range(start, stop):
            if i + PREFETCH_ROWS < stop:
                prefetch_run(e.base, e.copies + (i + PREFETCH_ROWS) * COPY_COLS)
            copy_run(e.base, e.copies + i * COPY_COLS)
    else:
        for i in range(start, stop):
            if i + PREFETCH_ROWS < stop:
                prefetch_single(e.base, e.runs + (i + PREFETCH_ROWS) * RUN_COLS)
            copy_single(e.base, e.runs + i * RUN_COLS, itemsize)
    return bad


cdef void work_on(Engine* e, ps_team* team, long long gen) noexcept nogil:
    """Claim and run chunks of the published phase ``gen`` until none is left. A chunk's bad indices are
    counted before its rows are marked done, so thread 0 has every count once the phase is done."""
    cdef long long first, n
    while True:
        n = ps_claim(team, gen, &first)
        if n == 0:
            return
        ps_add(&team.helper_bad, run_rows(e, team.kind, first, first + n, team.itemsize))
        ps_add(&team.done, n)


cdef void leave(Engine* e) noexcept nogil:
    if ps_release(&e.refs) == 0:
        free(e)


cdef void* helper_main(void* arg) noexcept nogil:
    """A helper thread: work on each newly published phase until thread 0 says the program is done. It may
    start late, even after the run: by then every phase is claimed, so it only leaves."""
    cdef Engine* e = <Engine*> arg
    cdef ps_team* team = &e.team
    cdef long long seen = 0, gen
    cdef int spins = 0
    while True:
        gen = ps_load(&team.gen)
        if gen != seen:
            seen, spins = gen, 0
            work_on(e, team, gen)
        elif ps_quitting(team):
            break
        else:
            ps_relax(&spins)
    leave(e)
    return NULL


cdef void run_phases(Engine* e, ps_team* team, bint shared, offset_t* result) noexcept nogil:
    """Thread 0: walk the phases (control flow included); with ``shared``, publish each compute or exchange
    phase to the helpers, work on it too, and wait only for the rows claimed. result: bad, cycles, dry, and
    the phase after a HOST_CALL phase where the run paused (else -1)."""
    cdef Py_ssize_t p = e.start, i, start, stop, kind, bad = 0, dry = -1, paused = -1
    cdef offset_t cycles = 0
    cdef long long gen = 0
    cdef const offset_t* ph
    cdef bint zero
    cdef int spins
    while p < e.num_phases:
        ph = e.phases + PHASE_COLS * p
        kind, start, stop = ph[PC_KIND], ph[PC_A], ph[PC_B]
        cycles += e.phase_cycles[p]
        p += 1
        if kind == PH_BRANCH_IF_ZERO:
            zero = True
            for i in range(stop):
                if e.base[start + i] != 0:
                    zero = False
            if zero:
                p = ph[PC_C]
        elif kind == PH_JUMP:
            p = start
        elif kind == PH_LOOP_INIT:
            e.counters[start] = stop
        elif kind == PH_LOOP_BACK:
            e.counters[start] -= 1
            if e.counters[start] > 0:
                p = stop
        elif kind == PH_SYNC:
            pass
        elif kind == PH_STREAM:
            if not stream_copy(e.base, e.host, e.streams + ST_COLS * start, e.stream_rows, stop, ph[PC_C]):
                dry = start
                break
        elif kind == PH_HOST_CALL:
            paused = p
            break
        elif shared and stop - start > 1:
            gen += 1
            ps_close(team, gen)
            team.kind, team.start, team.stop, team.itemsize = kind, start, stop, ph[PC_C]
            team.chunk = COMPUTE_CHUNK if kind == PH_COMPUTE else EXCHANGE_CHUNK
            team.done = 0
            ps_store(&team.ticket, gen << 32)
            ps_store(&team.gen, gen)
            work_on(e, team, gen)
            spins = 0
            while ps_load(&team.done) < stop - start:
                ps_relax(&spins)
        else:
            bad += run_rows(e, kind, start, stop, ph[PC_C])
    if shared:
        ps_quit(team)
    result[0], result[1], result[2], result[3] = bad, cycles, dry, paused


cdef bint worth_sharing(Engine* e) noexcept nogil:
    """Whether some compute or exchange phase has more rows than one claim, so a helper could take any."""
    cdef Py_ssize_t p
    cdef const offset_t* ph
    for p in range(e.num_phases):
        ph = e.phases + PHASE_COLS * p
        if ph[PC_KIND] == PH_COMPUTE and ph[PC_B] - ph[PC_A] > COMPUTE_CHUNK:
            return True
        if (ph[PC_KIND] == PH_EXCHANGE or ph[PC_KIND] == PH_RUNS) and ph[PC_B] - ph[PC_A] > EXCHANGE_CHUNK:
            return True
    return False


cdef void run_team(Engine* e, int num_threads, offset_t* result) noexcept nogil:
    """Run the phases on this thread with up to ``num_threads - 1`` detached helpers started for this run;
    it waits only for the rows they claimed, never for a helper to be scheduled or to exit. A helper that
    cannot be started is simply missing: this thread does its rows. Frees ``e`` (or its last helper does)."""
    cdef pthread_t helper
    cdef int started = 0, i
    if num_threads > 1 and worth_sharing(e):
        for i in range(num_threads - 1):
            ps_add(&e.refs, 1)
            if pthread_create(&helper, NULL, helper_main, e) == 0:
                pthread_detach(helper)
                started += 1
            else:
                ps_release(&e.refs)
    run_phases(e, &e.team, started > 0, result)


def run_program(TileArena arena, const offset_t[:, ::1] phases, const offset_t[::1] phase_cycles,
                const offset_t[:, ::1] instructions, const double[::1] fparams, const copy_t[:, ::1] copies,
                offset_t[::1] counters, const offset_t[:, ::1] stream_rows, offset_t[:, ::1] streams,
                byte_t[::1] host, int num_threads=1, Py_ssize_t start=0, const copy_t[:, ::1] runs=None):
    """Run a program's phases (see popsim/program.py for the phase kinds): a COMPUTE phase runs instruction
    rows start..stop-1 (one compute set), an EXCHANGE phase performs copy rows start..stop-1 (one exchange,
    see copy_run), a RUNS phase (RUNS, start, stop, itemsize) performs compact rows start..stop-1 of ``runs``
    (see copy_single; a Copy's rows of one repetition, beside its EXCHANGE phase), control phases branch on a tile-memory condition, jump or step loop counters in
    ``counters``, and a STREAM phase moves one slice of a host stream (see stream_copy). A HOST_CALL phase
    pauses the run so the host can run a callback; the caller resumes it from the phase returned (``start``),
    with the same ``counters`` and ``streams``.

    The rows of one compute or exchange phase are independent (BSP), so ``num_threads - 1`` helper threads
    claim chunks of them while thread 0 works too (see ps_team); phases run one after another. Returns how
    many dynamic gather/scatter indices were out of range, the sum of ``phase_cycles`` of the phases run, the
    slot of a host stream that ran dry (the run stops there) else -1, the first instruction row that
    trapped (an unknown kind or sub-op; it did nothing) else -1, and the phase to resume at after a host
    call else -1. The arrays must have passed
    popsim.validate.check_program for this arena.
    """
    cdef Engine* e
    cdef offset_t result[4]
    cdef long long bad, trap
    if not 1 <= num_threads <= MAX_THREADS:
        raise ValueError(f"num_threads must be between 1 and {MAX_THREADS}, got {num_threads}")
    if not 0 <= start <= phases.shape[0]:
        raise ValueError(f"start must be a phase from 0 to {phases.shape[0]}, got {start}")
    e = <Engine*> malloc(sizeof(Engine))
    if e == NULL:
        raise MemoryError()
    memset(e, 0, sizeof(Engine))
    e.base = arena.base
    e.host = &host[0] if host.shape[0] else NULL
    e.phases = &phases[0, 0] if phases.shape[0] else NULL
    e.num_phases = phases.shape[0]
    e.phase_cycles = &phase_cycles[0] if phase_cycles.shape[0] else NULL
    e.instructions = &instructions[0, 0] if instructions.shape[0] else NULL
    e.fparams = &fparams[0] if fparams.shape[0] else NULL
    e.copies = &copies[0, 0] if copies.shape[0] else NULL
    e.runs = &runs[0, 0] if runs is not None and runs.shape[0] else NULL
    e.counters = &counters[0] if counters.shape[0] else NULL
    e.stream_rows = &stream_rows[0, 0] if stream_rows.shape[0] else NULL
    e.streams = &streams[0, 0] if streams.shape[0] else NULL
    e.start = start
    e.trap = -1
    e.refs = 1
    with nogil:
        run_team(e, num_threads, result)
        bad, trap = result[0] + ps_load(&e.team.helper_bad), ps_load(&e.trap)
        leave(e)
    return bad, result[1], result[2], trap, result[3]
