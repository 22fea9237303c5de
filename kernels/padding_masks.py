"""A key-only mask that only pads a prompt: the same attention over fewer keys, without the mask.

HunyuanVideo, LTX-Video and Lumina 2 pad the prompt and mask the padding out: bias 0 (or True) on the kept keys,
-finfo.max (or False) on the padding. Under the spec, keys far below their row's largest bias are dead
(`quant.dead_keys`): they weigh nothing and enter no statistic, so attention with the mask is attention over the
other keys alone. `kept_keys` reads a mask once (a device sync) and says which keys can go:
  * every row keeps the same keys, all at bias 0: the call runs unmasked over them (a view of K and V when
    they are a prefix, one gather otherwise);
  * otherwise the keys that no row keeps, past the last kept one, are cut and the mask stays (a view).

`SeenMasks` decides when reading a mask pays: on the second call that passes the same mask object (a model
builds its mask once per evaluation and hands it to every block), never the first, so a mask made for one call
costs no sync. Identity is the mask's own object (weakly held), its view and, outside inference mode, its version
(an in-place write makes it a new mask). ComfyUI samples under inference mode, where tensors carry no version:
there a mask is taken as unchanged within one model evaluation, and the owner forgets every mask at the end of
each evaluation (`forget`). Never read under CUDA graph capture, where a sync is not allowed.
"""
from __future__ import annotations

import weakref
from typing import NamedTuple, Optional

import torch

from .call_spec import key_mask, mask_scope
from .quant import dead_keys, mask_bias_base2

MAX_SEEN = 16  # masks remembered per owner between two `forget`s; a model passes one or two per evaluation


class KeptKeys(NamedTuple):
    """Which keys of a mask's call can go. `end`: keys from `end` on are dead in every row. `drop_mask`: every row
    keeps the same keys, all at bias 0, so the mask can go. `index`: those keys' positions when they are not the
    prefix [0, end) (a gather), else None."""
    end: int
    drop_mask: bool
    index: Optional[torch.Tensor] = None

    def cuts_anything(self, kv_len: int) -> bool:
        return self.drop_mask or self.end < kv_len


def kept_keys(mask: torch.Tensor, kv_len: int) -> KeptKeys:
    """Read a key-only mask (`call_spec.mask_scope` "keys"; 2 to 4 dims, broadcasting to the call) and say which
    keys of a call with `kv_len` keys can go. One device sync (two when the kept keys are not a prefix); none for a
    mask that differs between query rows, of which nothing can go."""
    if mask_scope(mask) != "keys":
        return KeptKeys(kv_len, False)
    rows = key_mask(mask, kv_len)  # (Bm, Hm, Nk) view
    bias = mask_bias_base2(rows).reshape(-1, kv_len)
    dead = dead_keys(bias)
    kept_anywhere = ~dead.all(dim=0)
    positions = torch.arange(1, kv_len + 1, device=bias.device)
    end = (positions * kept_anywhere).amax()  # 1 + the last key some row keeps (every row keeps one)
    same_keys = (dead == dead[:1]).all()
    zero_bias = (bias.masked_fill(dead, 0.0) == 0).all()  # NaN is not 0
    prefix = kept_anywhere.sum() == end
    end, same_keys, zero_bias, prefix = torch.stack([end, same_keys.long(), zero_bias.long(), prefix.long()]).tolist()
    drop = bool(same_keys and zero_bias)
    index = None
    if drop and not prefix:
        index = torch.nonzero(kept_anywhere[:end]).flatten()
    return KeptKeys(int(end), drop, index)


class SeenMasks:
    """The masks one patch has met since its last `forget`, and what `kept_keys` said of each."""

    def __init__(self, max_seen: int = MAX_SEEN):
        self.max_seen = max_seen
        self._seen: dict = {}  # id(root tensor) -> (weakref to it, {view key: KeptKeys, or None when seen once})
        self.reads = 0  # kept_keys calls (device syncs), for tests and reports

    def forget(self) -> None:
        """The end of a model evaluation: a mask met later is read again."""
        self._seen.clear()

    def lookup(self, mask: torch.Tensor, kv_len: int) -> Optional[KeptKeys]:
        """What can go from a call with this key-only mask: None the first time the mask is met (and whenever it
        cannot be read now); on a later call with the same mask, what `kept_keys` read (read then, once)."""
        root = mask._base if mask._base is not None else mask
        # An in-place write bumps the version a normal tensor carries (an inference tensor carries none).
        version = None if mask.is_inference() else mask._version
        view = (tuple(mask.shape), mask.stride(), mask.storage_offset(), mask.dtype, kv_len, version)
        entry = self._seen.get(id(root))
        if entry is None or entry[0]() is not root:
            if len(self._seen) >= self.max_seen:
                return None
            self._seen[id(root)] = (weakref.ref(root), {view: None})
            return None
        views = entry[1]
        if view not in views:
            views[view] = None
            return None
        kept = views[view]
        if kept is None:
            if mask.is_cuda and torch.cuda.is_current_stream_capturing():
                return None
            kept = views[view] = kept_keys(mask, kv_len)
            self.reads += 1
        return kept


def padding_cut(seen: SeenMasks, k: torch.Tensor, v: torch.Tensor, mask, token_dim: int):
    """(k, v, mask, kept) with the keys `seen` knows to be dead cut along `token_dim`, or the inputs and None when
    nothing can go: no mask, a mask that differs between query rows, or one met for the first time."""
    if (mask is None or not isinstance(mask, torch.Tensor) or not 2 <= mask.dim() <= 4 or mask.requires_grad
            or not (mask.dtype == torch.bool or mask.is_floating_point()) or mask.device != k.device):
        return k, v, mask, None  # no mask, or one the call's own check reports (call_spec.check_shapes)
    kv_len = k.shape[token_dim]
    if kv_len == 0 or mask.shape[-1] not in (1, kv_len):
        return k, v, mask, None
    kept = seen.lookup(mask, kv_len)
    if kept is None or not kept.cuts_anything(kv_len):
        return k, v, mask, None
    if kept.index is not None:
        k, v = k.index_select(token_dim, kept.index), v.index_select(token_dim, kept.index)
    else:
        k, v = k.narrow(token_dim, 0, kept.end), v.narrow(token_dim, 0, kept.end)
    mask = None if kept.drop_mask else mask if mask.shape[-1] == 1 else mask.narrow(-1, 0, kept.end)
    return k, v, mask, kept
