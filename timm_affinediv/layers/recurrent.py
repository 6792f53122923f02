""" A divergence-corrected LSTM: the input map of its first layer divided by the norm of its augmented input

An LSTM's gates at step `t` are `W_ih x_t + b_ih + W_hh h_{t-1} + b_hh`: the input map `W_ih x_t + b_ih` is an
affine map of `x_t`, with the affine divergence `|x_t|^2 + 1` of any other (Sequencer's `norm -> LSTM`, where a
patchnorm slot feeds it). `AffineDivLSTM` divides it as `AffineDivLinear` divides its map:

    gates_t = (W_ih x_t + b_ih) / s(x_t) + W_hh h_{t-1} + b_hh,    s(x)^2 = (|x|^2 + 1) / c

so one SGD step on `weight_ih_l0` and `bias_ih_l0` moves the input map by exactly `c` times the ideal step, at
every step of every sequence. The recurrent map and the layers after the first are those of `nn.LSTM`.
"""
from typing import List, Optional, Tuple

import torch
import torch.nn as nn
from timm.layers import register_notrace_module
from torch.nn.utils.rnn import PackedSequence

from ..errors import ShapeError, UnsupportedTypeError
from .affine_div import augmented_input, check_scale, inverse_scale, norm_offset, unchecked_constant
from .patches import sq_norm

__all__ = ['AffineDivLSTM']

State = Tuple[torch.Tensor, torch.Tensor]


@register_notrace_module
class AffineDivLSTM(nn.LSTM):
    """ Divergence-corrected `nn.LSTM`, a drop-in for it (same parameters, names and shapes).

    Layer 0's input map is `(W_ih x + b_ih) / s(x)` over the last dimension, `s(x)^2 = (|x|^2 + 1) / c`
    (`(|x|^2 + eps) / c` without bias), `c = input_size + 1` for `scale="rms"`, 1 for "l2"; in each direction.
    Computed as `nn.LSTM` on `[x / s; 1 / s]` with `[W_ih b_ih]` as layer 0's input weights. Takes tensors, not
    `PackedSequence`s.
    """

    def __init__(self, *args, scale: str = 'rms', eps: float = 1e-12, **kwargs):
        super().__init__(*args, **kwargs)
        self.scale = check_scale(scale)
        self.eps = eps

    @property
    def divergence_constant(self) -> int:
        return unchecked_constant(self.input_size, self.bias, self.scale)

    def inv_scale(self, x: torch.Tensor) -> torch.Tensor:
        """`1 / s(x)` in float32 (or float64), shape `x.shape[:-1] + (1,)`."""
        with torch.autocast(x.device.type, enabled=False):
            return inverse_scale(sq_norm(x, -1), self.divergence_constant, norm_offset(self.bias, self.eps))

    def first_layer_maps(self) -> List[Tuple[torch.Tensor, Optional[torch.Tensor]]]:
        """`(weight_ih, bias_ih)` of layer 0 in each direction (bias None without biases): the corrected maps."""
        suffixes = ['', '_reverse'] if self.bidirectional else ['']
        return [(getattr(self, f'weight_ih_l0{s}'), getattr(self, f'bias_ih_l0{s}') if self.bias else None)
                for s in suffixes]

    def input_map(self, x: torch.Tensor) -> torch.Tensor:
        """ Layer 0's corrected input map `(W_ih x + b_ih) / s(x)`, the directions concatenated: `(..., D * 4H)`."""
        inv_s = self.inv_scale(x).to(x.dtype)
        return torch.cat([torch.nn.functional.linear(x, w, b) * inv_s for w, b in self.first_layer_maps()], -1)

    def forward(self, input: torch.Tensor, hx: Optional[State] = None) -> Tuple[torch.Tensor, State]:
        if isinstance(input, PackedSequence):
            raise UnsupportedTypeError('AffineDivLSTM takes padded tensors, not PackedSequence; pad the sequences '
                                       'first')
        if input.dim() not in (2, 3) or input.size(-1) != self.input_size:
            raise ShapeError(f'AffineDivLSTM expects (N, L, {self.input_size}) or (L, {self.input_size}) input '
                             f'(batch_first={self.batch_first}), got {tuple(input.shape)}')
        batched = input.dim() == 3
        batch_dim = 0 if self.batch_first else 1
        x = input if batched else input.unsqueeze(batch_dim)
        inv_s = self.inv_scale(x)
        weights = [getattr(self, name) for name in self._flat_weights_names]
        maps = self.first_layer_maps()
        per_direction = len(weights) // (self.num_layers * len(maps))
        # the directions' maps stacked, so that the input is augmented once
        weight = torch.cat([w for w, _ in maps])
        bias = torch.cat([b for _, b in maps]) if self.bias else None
        augmented_x, augmented_weight = augmented_input(x, inv_s, weight, bias, -1)
        for d, direction_weight in enumerate(augmented_weight.chunk(len(maps))):
            weights[d * per_direction] = direction_weight
            if bias is not None:  # the bias is a column of the augmented weight, divided with the rest
                weights[d * per_direction + 2] = torch.zeros_like(maps[d][1])
        if hx is None:
            directions, n = 2 if self.bidirectional else 1, x.size(batch_dim)
            h0 = x.new_zeros(self.num_layers * directions, n, self.proj_size or self.hidden_size)
            hx = (h0, x.new_zeros(self.num_layers * directions, n, self.hidden_size))
        elif not batched:
            hx = (hx[0].unsqueeze(1), hx[1].unsqueeze(1))
        output, h, c = torch.lstm(augmented_x, hx, weights, self.bias, self.num_layers, float(self.dropout),
                                  self.training, self.bidirectional, self.batch_first)
        if not batched:
            return output.squeeze(batch_dim), (h.squeeze(1), c.squeeze(1))
        return output, (h, c)

    def extra_repr(self) -> str:
        return f'{super().extra_repr()}, scale={self.scale}'

    @classmethod
    def from_lstm(cls, lstm: nn.LSTM, scale: str = 'rms') -> 'AffineDivLSTM':
        """The divergence-corrected form of `lstm`, sharing its parameters."""
        new = cls(lstm.input_size, lstm.hidden_size, num_layers=lstm.num_layers, bias=lstm.bias,
                  batch_first=lstm.batch_first, dropout=lstm.dropout, bidirectional=lstm.bidirectional,
                  proj_size=lstm.proj_size, scale=scale, device='meta')
        for name in lstm._flat_weights_names:
            setattr(new, name, getattr(lstm, name))
        return new.train(lstm.training)
