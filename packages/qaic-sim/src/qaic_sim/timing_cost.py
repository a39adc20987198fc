"""What one run of a compiled program costs: FLOPs and the bytes it moves, from a config or an ONNX graph."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

from qaic_sim.mx import bytes_per_element
from qaic_sim.timing_shape import DecoderShape

if TYPE_CHECKING:
    import onnx

ACTIVATION_BYTES = 2.0
"""On-device activations are fp16 (-convert-to-fp16); collectives move fp16."""


def side_bytes_per_element(weight_bytes_per_param: float) -> float:
    """Norms, biases and embedding tables stay fp16 when matmul weights are fp16 or MX (fp32 programs keep fp32)."""
    return max(weight_bytes_per_param, ACTIVATION_BYTES)


def _positive(**values: int) -> None:
    for name, value in values.items():
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")


@dataclass(frozen=True)
class ProgramCost:
    """FLOPs and bytes of one run of one specialization; ``device_time_s`` turns it into seconds."""

    flops: float
    weight_bytes: float
    """Weight bytes read from DDR per run (every matmul weight; gathered embedding rows only)."""
    kv_read_bytes: float = 0.0
    kv_write_bytes: float = 0.0
    activation_bytes: float = 0.0
    """Host I/O per run: inputs and outputs other than the KV cache."""
    tokens: int = 1
    """Rows each weight matmul processes (batch x seq_len); sets the tensor unit's utilisation."""
    allreduces: int = 0
    """Collectives per run when the program is tensor-sliced over several devices."""
    allreduce_bytes: float = 0.0
    """fp16 payload of those collectives, summed over the run."""
    weight_storage_bytes: float = 0.0
    kv_storage_bytes: float = 0.0

    @property
    def ddr_bytes(self) -> float:
        """Bytes one run streams through DDR."""
        return self.weight_bytes + self.kv_read_bytes + self.kv_write_bytes

    def to_json(self) -> dict[str, float]:
        """The fields as a JSON object (the compiler stores one per specialization)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_json(cls, data: Mapping[str, Any], where: str) -> ProgramCost:
        """A cost read back from :meth:`to_json`; anything else is an error naming ``where``."""
        names = {f.name for f in fields(cls)}
        if not isinstance(data, Mapping) or set(data) - names or "flops" not in data:
            raise ValueError(f"{where}: malformed program cost {data!r}; compile the program again")
        values: dict[str, Any] = {
            k: int(v) if k in ("tokens", "allreduces") else float(v) for k, v in data.items()
        }
        return cls(**values)

    @classmethod
    def from_onnx(
        cls,
        model: onnx.ModelProto,
        symbols: Mapping[str, int],
        *,
        weight_bytes_per_param: float,
        kv_bytes_per_elem: float,
    ) -> ProgramCost:
        """Walk an exported graph with its symbols bound (see ``timing_onnx``)."""
        from qaic_sim.timing_onnx import onnx_cost

        return onnx_cost(
            model, symbols, weight_bytes_per_param=weight_bytes_per_param, kv_bytes_per_elem=kv_bytes_per_elem
        )

    @classmethod
    def for_decoder(
        cls,
        config: Mapping[str, Any] | Any,
        *,
        batch: int,
        seq_len: int,
        ctx_len: int,
        weight_precision: str = "float16",
        kv_precision: str = "float16",
    ) -> ProgramCost:
        """Cost of one run of a QEfficient-style causal-LM program of shape (batch, seq_len, ctx_len)."""
        _positive(batch=batch, seq_len=seq_len, ctx_len=ctx_len)
        if seq_len > ctx_len:
            raise ValueError(
                f"seq_len {seq_len} exceeds ctx_len {ctx_len}; raise ctx_len or chunk the prompt"
            )
        s = DecoderShape.from_config(config)
        wb, kvb = bytes_per_element(weight_precision), bytes_per_element(kv_precision)
        side = side_bytes_per_element(wb)
        tokens = batch * seq_len
        h, layers = s.hidden_size, s.num_layers
        q_out = s.num_heads * s.head_dim
        kv_out = s.num_kv_heads * s.head_dim
        experts_read = min(s.num_experts, tokens * s.experts_per_token) if s.num_experts else 1
        experts_used = s.experts_per_token if s.num_experts else 1
        router = h * s.num_experts
        layer_read = s.attention_params + experts_read * s.expert_params + router
        layer_used = s.attention_params + experts_used * s.expert_params + router
        lm_head = h * s.vocab_size
        bias = (q_out + 2 * kv_out + h if s.attention_bias else 0) + (
            experts_read * (s.intermediate_size + h) if s.mlp_bias else 0
        )
        norms = 2 * h
        attention_flops = (
            4 * tokens * s.num_heads * s.head_dim * ctx_len
        )  # QK^T and PV over the static window
        # Logits come only from the last valid position of each row (argmax of position_ids).
        flops = layers * (2 * tokens * layer_used + attention_flops) + 2 * batch * lm_head
        weight_bytes = (layers * layer_read + lm_head) * wb + (
            layers * (bias + norms) + h + tokens * h
        ) * side
        kv_per_token = s.kv_elements_per_token * kvb
        tied = bool(
            config.get("tie_word_embeddings", True)
            if isinstance(config, Mapping)
            else getattr(config, "tie_word_embeddings", True)
        )
        storage = (
            layers * (s.attention_params + max(s.num_experts, 1) * s.expert_params + router) + lm_head
        ) * wb
        storage += (layers * (bias + norms) + h + (0 if tied else lm_head)) * side
        return cls(
            flops=float(flops),
            weight_bytes=float(weight_bytes),
            kv_read_bytes=float(batch * ctx_len * kv_per_token),
            kv_write_bytes=float(tokens * kv_per_token),
            activation_bytes=float(2 * tokens * 8 + batch * s.vocab_size * 4),
            tokens=tokens,
            allreduces=2 * layers,
            allreduce_bytes=float(2 * layers * tokens * h * ACTIVATION_BYTES),
            weight_storage_bytes=float(storage),
            kv_storage_bytes=float(batch * ctx_len * kv_per_token),
        )
