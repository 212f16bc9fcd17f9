"""Each Mamba layer's model geometry (heads, groups, d_state, conv kernel...), from vLLM's model class.

The mamba strategy needs it as hint ``mamba``: a per-rank state shape cannot tell a B/C group
replicated on every rank from a sharded one. Models name these fields differently in their
config (``mamba_num_heads``, ``num_heads``, ``linear_num_value_heads``...), so the geometry is
read back from what the model class itself computes, ``get_mamba_state_shape_from_config``,
evaluated at TP 1 without speculative tokens, where nothing is sharded or replicated:

    Mamba2 / GDN   conv (x | B | C channels, kernel - 1)   ssm (heads, head_dim, d_state)
    Mamba1         conv (intermediate, kernel - 1)         ssm (intermediate, d_state)

with ``conv channels = heads x head_dim + 2 x n_groups x d_state`` (GDN: value heads, and key
heads as groups). The strategy then checks it against the shapes each rank actually holds.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from typing import Any

from ..core.errors import IncompatibleGeometry


def mamba_layer_types(kv_cache_config: Any) -> dict[str, str]:
    """Layer name -> mamba type (MAMBA2, GDN_ATTN, MAMBA1...) of every Mamba layer."""
    from vllm.v1.kv_cache_interface import MambaSpec

    out = {}
    for group in kv_cache_config.kv_cache_groups:
        spec = group.kv_cache_spec
        if isinstance(spec, MambaSpec):
            kind = getattr(spec.mamba_type, "name", str(spec.mamba_type))
            out.update({name: kind for name in group.layer_names})
    return out


def mamba_hints_by_layer(vllm_config: Any, kv_cache_config: Any) -> Callable[[str], Mapping[str, Any]] | None:
    """``model_hints`` for :func:`nixlkv.vllm.kv_views.layer_caches`, or None for a model without Mamba layers."""
    types = mamba_layer_types(kv_cache_config)
    if not types:
        return None
    conv, ssm = _unsharded_state_shapes(vllm_config)
    layout = _conv_state_layout()
    by_type = {kind: {"mamba": {**geometry(kind, conv, ssm, layout), "conv_state_layout": layout}} for kind in set(types.values())}
    return lambda name: by_type[types[name]] if name in types else {}


def geometry(kind: str, conv: tuple[int, ...], ssm: tuple[int, ...], layout: str) -> dict[str, int]:
    """The model geometry of a layer whose unsharded (TP 1) states have these shapes."""
    channels, rows = (conv[0], conv[1]) if layout == "DS" else (conv[1], conv[0])
    if kind == "MAMBA1":
        if len(ssm) != 2:
            raise IncompatibleGeometry(f"a Mamba1 SSM state is (intermediate, d_state); the model gives {ssm}")
        return {"num_heads": 1, "head_dim": 1, "n_groups": 1, "d_state": ssm[1], "intermediate_size": ssm[0],
                "conv_kernel": rows + 1}
    if len(ssm) != 3:
        raise IncompatibleGeometry(f"a {kind} SSM state is (heads, head_dim, d_state); the model gives {ssm}")
    heads, head_dim, d_state = ssm
    groups, rest = divmod(channels - heads * head_dim, 2 * d_state)
    if rest or groups < 1:
        raise IncompatibleGeometry(
            f"a {kind} conv state of {channels} channels is not heads x head_dim ({heads} x {head_dim}) plus "
            f"2 x n_groups x d_state ({d_state}): nixlkv cannot tell this model's B/C groups"
        )
    return {"num_heads": heads, "head_dim": head_dim, "n_groups": groups, "d_state": d_state,
            "intermediate_size": heads * head_dim, "conv_kernel": rows + 1}


class _Unsharded:
    """The engine's VllmConfig seen at TP 1 without speculative tokens (what the model class reads)."""

    num_speculative_tokens = 0

    def __init__(self, vllm_config: Any) -> None:
        self._config = vllm_config
        self.parallel_config = copy.copy(vllm_config.parallel_config)
        self.parallel_config.tensor_parallel_size = 1
        self.speculative_config = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._config, name)


def _unsharded_state_shapes(vllm_config: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    from vllm.model_executor.models import ModelRegistry

    model_config = vllm_config.model_config
    model_cls, _ = ModelRegistry.resolve_model_cls(model_config.architecture, model_config=model_config)
    name = getattr(model_cls, "__name__", str(model_cls))
    if hasattr(model_cls, "get_mamba_specs_from_config"):
        raise NotImplementedError(
            f"{name} declares several Mamba state layouts (get_mamba_specs_from_config); nixlkv derives one "
            "geometry per model and does not serve such models yet"
        )
    if not hasattr(model_cls, "get_mamba_state_shape_from_config"):
        raise IncompatibleGeometry(f"{name} has Mamba layers but no get_mamba_state_shape_from_config to read their geometry from")
    shapes = model_cls.get_mamba_state_shape_from_config(_Unsharded(vllm_config))
    if len(shapes) != 2:
        raise NotImplementedError(
            f"{name} has {len(shapes)} Mamba states {shapes}; nixlkv moves a (conv, ssm) pair only "
            "(ReplaySSM ring states are not supported)"
        )
    conv, ssm = (tuple(int(x) for x in s) for s in shapes)
    return conv, ssm


def _conv_state_layout() -> str:
    """The conv state orientation vLLM builds (``VLLM_SSM_CONV_STATE_LAYOUT``): DS or SD."""
    from vllm.model_executor.layers.mamba import mamba_utils

    return str(mamba_utils.get_conv_state_layout())
