"""Recurrent cells as composites, with torch's weight layouts and gate orders."""

from popir.ops.elementwise import relu, sigmoid, tanh
from popir.ops.layers import linear
from popir.ops.rearrange import chunk


def linear_gates(x, h, w_ih, w_hh, b_ih, b_hh):
    """x W_ih^T + b_ih + h W_hh^T + b_hh: the pre-activations of every gate."""
    return linear(x, w_ih, b_ih) + linear(h, w_hh, b_hh)


def rnn_cell(x, h, w_ih, w_hh, b_ih=None, b_hh=None, nonlinearity="tanh"):
    """torch.nn.RNNCell: act(x W_ih^T + b_ih + h W_hh^T + b_hh)."""
    pre = linear_gates(x, h, w_ih, w_hh, b_ih, b_hh)
    return tanh(pre) if nonlinearity == "tanh" else relu(pre)


def lstm_cell(x, h, c, w_ih, w_hh, b_ih=None, b_hh=None):
    """torch.nn.LSTMCell: gates (input, forget, cell, output); returns (h', c')."""
    i, f, g, o = chunk(linear_gates(x, h, w_ih, w_hh, b_ih, b_hh), 4, axis=-1)
    c_next = sigmoid(f) * c + sigmoid(i) * tanh(g)
    return sigmoid(o) * tanh(c_next), c_next


def gru_cell(x, h, w_ih, w_hh, b_ih=None, b_hh=None):
    """torch.nn.GRUCell: gates (reset, update, new); n = tanh(x_n + r * h_n)."""
    xr, xz, xn = chunk(linear(x, w_ih, b_ih), 3, axis=-1)
    hr, hz, hn = chunk(linear(h, w_hh, b_hh), 3, axis=-1)
    r, z = sigmoid(xr + hr), sigmoid(xz + hz)
    n = tanh(xn + r * hn)
    return (1.0 - z) * n + z * h
