# The engine's thread team (see _kernels.run_program): atomics on one shared struct, and detached POSIX
# threads started for one run, so no pool outlives a run and a forked child starts clean.

cdef extern from *:
    """
    #include <sched.h>
    /* The engine's team: thread 0 walks the program and publishes each compute or exchange phase; helper
       threads claim chunks of its rows while they are running. Nobody waits for a helper that claimed
       nothing, so a helper thread the OS has descheduled (a busy machine) costs no barrier; thread 0 then
       simply does the rows itself. A claim is a compare-and-swap on (generation << 32 | next row offset),
       so a late helper can never take rows of a later phase for an earlier one. */
    typedef struct {
        long long ticket, done, gen, helper_bad;
        long long kind, start, stop, chunk, itemsize;
        int quit;
    } ps_team;
    static inline long long ps_load(long long* p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
    static inline void ps_store(long long* p, long long v) { __atomic_store_n(p, v, __ATOMIC_RELEASE); }
    static inline void ps_add(long long* p, long long v) { __atomic_add_fetch(p, v, __ATOMIC_ACQ_REL); }
    static inline long long ps_release(long long* p) { return __atomic_sub_fetch(p, 1, __ATOMIC_ACQ_REL); }
    static inline int ps_quitting(ps_team* t) { return __atomic_load_n(&t->quit, __ATOMIC_ACQUIRE); }
    static inline void ps_quit(ps_team* t) { __atomic_store_n(&t->quit, 1, __ATOMIC_RELEASE); }
    /* Close the ticket to claims before a new phase's fields are written: a helper still holding the old
       generation then fails its compare-and-swap instead of claiming rows of the new phase. */
    static inline void ps_close(ps_team* t, long long gen) {
        __atomic_exchange_n(&t->ticket, (gen << 32) | 0xffffffffLL, __ATOMIC_ACQ_REL);
    }
    static inline long long ps_claim(ps_team* t, long long gen, long long* first) {
        long long total = t->stop - t->start, ticket = __atomic_load_n(&t->ticket, __ATOMIC_ACQUIRE);
        for (;;) {
            long long off = ticket & 0xffffffffLL, next;
            if ((ticket >> 32) != gen || off >= total) return 0;
            next = off + t->chunk < total ? off + t->chunk : total;
            if (__atomic_compare_exchange_n(&t->ticket, &ticket, (gen << 32) | next, 1, __ATOMIC_ACQ_REL,
                                            __ATOMIC_ACQUIRE)) {
                *first = t->start + off;
                return next - off;
            }
        }
    }
    /* Store v unless *p already holds a value other than -1 (the first trap stays). */
    static inline long long ps_set_once(long long* p, long long v) {
        long long none = -1;
        __atomic_compare_exchange_n(p, &none, v, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE);
        return none;
    }
    static inline void ps_pause(void) {
    #if defined(__x86_64__) || defined(__i386__)
        __builtin_ia32_pause();
    #endif
    }
    /* One round of a wait: spin (a phase's rows are usually done within microseconds), then give the core
       away. With more runnable threads than cores, the thread waited for may need this very core: spinning
       on would hold it off for a whole time slice at each phase. */
    #define PS_SPINS 4096
    static inline void ps_relax(int* spins) {
        if (*spins < PS_SPINS) {
            ++*spins;
            ps_pause();
        } else {
            sched_yield();
        }
    }
    """
    ctypedef struct ps_team:
        long long ticket, done, gen, helper_bad, kind, start, stop, chunk, itemsize
        int quit
    long long ps_load(long long* p) noexcept nogil
    void ps_store(long long* p, long long v) noexcept nogil
    void ps_add(long long* p, long long v) noexcept nogil
    long long ps_release(long long* p) noexcept nogil
    int ps_quitting(ps_team* t) noexcept nogil
    void ps_quit(ps_team* t) noexcept nogil
    void ps_close(ps_team* t, long long gen) noexcept nogil
    long long ps_claim(ps_team* t, long long gen, long long* first) noexcept nogil
    void ps_pause() noexcept nogil
    void ps_relax(int* spins) noexcept nogil
    long long ps_set_once(long long* p, long long v) noexcept nogil


cdef extern from "<pthread.h>" nogil:
    ctypedef unsigned long pthread_t
    ctypedef struct pthread_attr_t:
        pass
    int pthread_create(pthread_t* thread, const pthread_attr_t* attr, void* (*start)(void*) noexcept nogil,
                       void* arg)
    int pthread_detach(pthread_t thread)
