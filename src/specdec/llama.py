"""The one decode path for Llama-family models: `BatchLlama`, the model protocol
(`specdec.lm.LM`) with B cache slots scored in one ragged pass (a decoder's target and draft
models, training's feature reader), its weights, products and attention (`LlamaWeights`,
`exact_attention`).

A 2-layer prophet spends most of a Hugging Face forward call in Python (module calls,
mask construction, cache bookkeeping), not in arithmetic, and that overhead is the
draft cost c that speculative decoding pays K times a round. This path runs the same
weights (read from the loaded Hugging Face model, nothing converted on disk) with fused
QKV and gate/up projections and KV buffers written by position, so a rollback is only a
length change (as in gpt-fast). Its logits match the Hugging Face model's to float
tolerance (tested); exactness of speculative decoding never depends on it, since the
verifier uses whatever q the prophet actually sampled from.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from specdec import families, layerloop, qgemm
from specdec.attention import Scores, exact_attention, one_query, scored_attention
from specdec.defaults import KV_DTYPES, PREFILL_CHUNK, choice
from specdec.heap import TRIM_BYTES
from specdec.int4 import ATTR as INT4_ATTR
from specdec.int4 import Int4Weight, int4_row_policy
from specdec.lm import tree_depths, tree_layout
from specdec.rowpolicy import row_policy_for, row_product


class Int8Weight:
    """A (rows, K) weight quantized to int8 per output row (weight-only, one scale per row):
    x @ W.T through PyTorch's int8 weight kernel, activations in act_dtype. The products of
    a compressed copy of a model to draft with (`--draft TARGET:int8`)."""

    def __init__(self, weight: torch.Tensor, act_dtype: torch.dtype) -> None:
        with torch.no_grad():
            w = weight.float()
            scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127
            self.q = (w / scale[:, None]).round().clamp(-127, 127).to(torch.int8).contiguous()
            self.scale = scale.to(act_dtype)
        self.act_dtype = act_dtype
        self.shape = self.q.shape

    def mm(self, x: torch.Tensor) -> torch.Tensor:
        """x (..., K) -> (..., rows), in act_dtype."""
        flat = x.reshape(-1, x.shape[-1]).to(self.act_dtype)
        return torch._weight_int8pack_mm(flat, self.q, self.scale).view(*x.shape[:-1], self.shape[0])


# a product's weight: float, 4-bit (specdec.int4, `--dtype int4`) or int8 (a drafting copy)
Weight = torch.Tensor | Int4Weight | Int8Weight


def _int8_of(owner: Any, name: str, act_dtype: torch.dtype, weight: torch.Tensor, key: Any) -> Int8Weight:
    """The int8 copy of one of owner's products, made once and kept on it (keyed by the
    float weight's identity and the activations' dtype): every view shares it."""
    cache = owner.__dict__.setdefault("_specdec_int8", {})
    full = (key, act_dtype)
    if name not in cache or cache[name][0] != full:
        cache[name] = (full, Int8Weight(weight, act_dtype))
    return cache[name][1]


def supports(model: Any) -> bool:
    """Whether this path runs a loaded model: a family file takes it (`specdec.families`)."""
    return families.supports(model)


def grown_capacity(positions: int, initial: int, max_length: int) -> int:
    """The size of a KV buffer that must hold `positions`: the initial capacity, doubled as
    often as needed, at most the context. Every lean cache grows so."""
    size = min(initial, max_length)
    while size < min(positions, max_length):
        size = min(max_length, 2 * size)
    return size


def kv_dtype_for(lm: Any, want: str | torch.dtype | None = None) -> torch.dtype:
    """The dtype a lean model's KV cache holds. `want` (`load(kv_dtype=...)`, `--kv-dtype`), else
    SPECDEC_KV_DTYPE, chooses: "auto" (the default) keeps
    keys and values in float16 where the model is a 4-bit target with float32 activations on the
    CPU (as llama.cpp keeps its cache: half the memory, and at long contexts a step streams half
    the bytes), else in the model's dtype; "float32" or "float16" force that dtype for float32
    models (bfloat16 and float16 models keep their own). Every read converts float16 to float32
    exactly, so a cache of either dtype is read alike by every path (steps, verification passes,
    prompt blocks, trees): exactness never depends on it."""
    if isinstance(want, torch.dtype):
        want = {torch.float32: "float32", torch.float16: "float16"}.get(want, str(want))
    want = choice("SPECDEC_KV_DTYPE", KV_DTYPES, want, "kv_dtype")
    if lm.embed.dtype != torch.float32:
        return lm.embed.dtype
    if want == "auto":
        return torch.float16 if lm.int4 and lm.embed.device.type == "cpu" else torch.float32
    return torch.float16 if want == "float16" else torch.float32


class LlamaWeights:
    """What the Llama path (`BatchLlama`) reads from a loaded
    plain Llama model: shapes, the weights (fused QKV and gate/up), rotary tables, RMSNorm.

    A model loaded with dtype int4 carries 4-bit products (`specdec.int4source.attach_int4`):
    those products (and the head) are then `Int4Weight`s, multiplied by PyTorch's CPU int4
    kernel, with everything else in float32; `int4=False` reads the float weights only.
    `int8=True`: the float weights' products (and the head) quantized to int8 per output row,
    activations in act_dtype (`Int8Weight`), made once per layer and shared by every view."""

    def __init__(self, model: Any, name: str, vocab_size: int | None = None, int4: bool = True,
                 int8: bool = False, act_dtype: torch.dtype = torch.float32) -> None:
        why = families.why_not(model)
        if why is not None:
            raise ValueError(f"'{name}' cannot run on the fast path ({why}); use specdec.hf.HFLM")
        cfg = model.config
        family = families.family_of(cfg)
        assert family is not None
        self.arch = family.arch(cfg)
        self.model = model
        self.name = name
        self.vocab_size = vocab_size or cfg.vocab_size
        self.max_length = int(cfg.max_position_embeddings)
        self.eps = cfg.rms_norm_eps
        self.n_heads = cfg.num_attention_heads
        self.n_kv = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        inner = model.model
        source = getattr(model, INT4_ATTR, None) if int4 and not int8 else None
        self.int4 = source is not None
        self.int8, self.act_dtype = int8, act_dtype
        with torch.no_grad():
            # (with dtype int4 from a GGUF file: its Q8_0 blocks, the same rows in a quarter of the memory)
            self.embed: Any = inner.embed_tokens.weight if source is None or source.embed is None else source.embed
            self.layers = [self._layer_weights(layer, family.parts(layer), self.arch.norm_offset,
                                               source.layers[i] if source is not None else {},
                                               act_dtype if int8 else None)
                           for i, layer in enumerate(inner.layers)]
            self.final_norm = self._offset(inner.norm.weight, self.arch.norm_offset)
            # tied embeddings: the same tensor; with dtype int4 an Int4Weight (the float one: head())
            self.lm_head: Any = model.lm_head.weight[: self.vocab_size]
            if source is not None and source.head is not None:
                self.lm_head = source.head.first_rows(self.vocab_size)
            if int8:
                self.lm_head = _int8_of(model.lm_head, "weight", act_dtype,
                                        model.lm_head.weight[: self.vocab_size],
                                        (model.lm_head.weight.data_ptr(), self.vocab_size))
            dtype = self.embed.dtype
            # the rotary tables by the name layers read them under (`Arch.rope`): cos and sin_signed (T, hd), sin
            # with the rotation's sign folded in: x * cos + roll(x, hd/2) * sin_signed is x * cos + cat(-x2, x1) *
            # sin bit for bit ((-a) * b == a * (-b)), in two ops fewer
            self.ropes: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
            for kind, (inv_freq, scale) in families.rope_tables(model).items():
                positions = torch.arange(self.max_length, dtype=torch.float, device=self.embed.device)
                freqs = positions[:, None] * inv_freq.float().to(positions.device)[None, :]  # (T, hd/2)
                emb = torch.cat([freqs, freqs], dim=-1)
                cos, sin = (emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype)  # (T, hd)
                half = sin.shape[-1] // 2
                self.ropes[kind] = (cos, torch.cat([-sin[:, :half], sin[:, half:]], dim=-1))
                if kind == self.arch.rope(0):
                    self.cos, self.sin, self.sin_signed = cos, sin, self.ropes[kind][1]

        # In bfloat16 (or float16) on a CPU, torch multiplies through oneDNN, which builds and
        # keeps a kernel for every row count it meets (an LRU of up to 1,024 of them): a
        # server that meets every (rows x new tokens) would grow for thousands of requests.
        # Padding the rows to a bucket keeps it to a few dozen kernels per weight shape.
        # With int4 weights too: each product rounds its input rows to bfloat16, so a float32
        # difference of one ulp (attention over n queries at once against one) can move a
        # row by a bf16 step; the rows are handled as in bfloat16 (subclasses' exact_rows:
        # scored rows attend alone; float products, if any, padded as probed).
        self.bucket_rows = self.embed.device.type == "cpu" and (
            self.embed.dtype in (torch.bfloat16, torch.float16) or self.int4)
        # And the row counts it pads to are ones whose rows round exactly as a one-row product
        # does on this machine's kernels (see ROW_POLICIES), probed once per weight shapes.
        self.row_policy = self._probe_rows() if self.bucket_rows else "none"
        # The 4-bit products' rows: "none" where the int4 kernel computes each row alike
        # whatever the row count (probed once per shapes), else "solo" (each row alone).
        self.int4_rows = self._probe_int4_rows() if self.int4 else "none"
        # Which kernel the 4-bit products run on ("blocks" or "torch", see specdec.int4.kernel_choice)
        self.int4_kernel = next((w.kernel for w in (*self.layers[0].values(), self.lm_head)
                                 if isinstance(w, Int4Weight)), "") if self.int4 and self.layers else ""

    def _probe_rows(self) -> str:
        layer = self.layers[0]
        weights = [w for w in (*(layer[name] for name in ("qkv", "o", "gate_up", "down")), self.lm_head)
                   if isinstance(w, torch.Tensor)]
        key = (self.embed.dtype, str(self.device), *(tuple(w.shape) for w in weights))
        if not weights:  # all 4-bit: see int4_rows
            return "none"
        return row_policy_for(key, weights)

    def _probe_int4_rows(self) -> str:
        layer = self.layers[0]
        weights = [w for w in (layer[name] for name in ("qkv", "o", "gate_up", "down")) if isinstance(w, Int4Weight)]
        return int4_row_policy(weights, self.lm_head if isinstance(self.lm_head, Int4Weight) else None)

    def matmul(self, x: torch.Tensor, weight: Weight) -> torch.Tensor:
        """x (..., D) @ weight.T: a 4-bit weight through the int4 kernel (rows as `int4_rows`
        says); a float one with its rows padded as `row_policy` says where `bucket_rows` says so;
        float32 on the CPU through `qgemm.f32_product` (a few rows: specdec's kernel, rows invariant)."""
        if isinstance(weight, Int4Weight):
            return weight.mm(x, self.int4_rows)
        if isinstance(weight, Int8Weight):
            return weight.mm(x)
        if not self.bucket_rows:
            return qgemm.f32_product(x, weight)
        flat = x.reshape(-1, x.shape[-1])
        return row_product(flat, weight, self.row_policy).view(*x.shape[:-1], weight.shape[0])

    @property
    def n_layers(self) -> int:
        return len(self.layers)

    @property
    def device(self) -> torch.device:
        """Where the weights, caches and every tensor this path makes live."""
        return self.embed.device

    def _linear(self, x: torch.Tensor, w: dict[str, Any], name: str) -> torch.Tensor:
        """x @ W.T for the product `name` of a layer's weights w."""
        return self.matmul(x, w[name])

    def mlp(self, x: torch.Tensor, w: dict[str, Any]) -> torch.Tensor:
        """A layer's MLP on the residual stream x: down(act(gate) * up) of its pre-MLP norm (and,
        where the family has one, the norm of that output)."""
        gate, up = self._linear(self.rms_norm(x, w["post_norm"]), w, "gate_up").chunk(2, dim=-1)
        act = F.silu(gate) if self.arch.act == "silu" else F.gelu(gate, approximate="tanh")
        out = self._linear(act * up, w, "down")
        return self.rms_norm(out, w["mlp_out_norm"]) if "mlp_out_norm" in w else out

    @staticmethod
    def _offset(weight: torch.Tensor, offset: float) -> torch.Tensor:
        """A norm's weight as the path scales by it: (offset + weight) in float32 where the family
        scales so (Gemma: 1 + weight), made once and kept on the tensor's owner."""
        return weight if offset == 0.0 else (weight.float() + offset).to(weight.dtype)

    @staticmethod
    def _layer_weights(layer: Any, parts: dict[str, Any], norm_offset: float, int4: dict[str, Int4Weight],
                       int8: torch.dtype | None = None) -> dict[str, Any]:
        """The layer's norms and products (fused: q|k|v, gate|up) from its family's parts
        (`specdec.families`), each product 4-bit where `int4` holds it, or (int8: the activations'
        dtype) every product int8; the extras some families add (biases, q/k norms, output norms)."""
        weights: dict[str, Any] = {}
        # Fused once per layer and shared by every view of the model (each one-sequence view,
        # each batched engine): a float32 SmolLM2 would otherwise hold 0.28 GB more per view.
        cache = layer.__dict__.setdefault("_specdec_fused", {})
        for name, part in parts.items():
            if name in int4:
                weights[name] = int4[name]
                continue
            tensors = part if isinstance(part, (list, tuple)) else [part]
            key = (tuple((t.data_ptr(), t.dtype, t.device, t._version) for t in tensors), norm_offset)
            if name not in cache or cache[name][0] != key:
                value = families.fused(part)
                if name.endswith("_norm"):
                    value = LlamaWeights._offset(value, norm_offset)
                cache[name] = (key, value)
            weights[name] = cache[name][1]
            if int8 is not None and name in families.PRODUCTS:
                weights[name] = _int8_of(layer, name, int8, cache[name][1], key)
        return weights

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """RMSNorm as Llama computes it (in float32). x (..., D)."""
        if x.dtype == torch.float32:  # one op instead of six: the extension's (as the C++ loop's), else PyTorch's
            ext = layerloop.kernels() if x.device.type == "cpu" and weight.dtype == torch.float32 else None
            if ext is not None:
                return ext.rms_norm(x, weight, self.eps)  # type: ignore[no-any-return]
            return F.rms_norm(x, (x.shape[-1],), weight, self.eps)
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return weight * x32.to(x.dtype)

    @staticmethod
    def rotate(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
        """Rotary positions: x (..., n, hd), cos and `sin_signed` (n, hd) at x's positions."""
        return x * cos + torch.roll(x, x.shape[-1] // 2, dims=-1) * sin_signed


class _Tree(NamedTuple):
    """A row's token tree in one pass: its mask (`tree_layout`'s) and, where scored rows must
    attend as one-token steps (`exact_rows`), the key positions each node sees, in order."""

    mask: torch.Tensor
    node_keys: list[torch.Tensor]
    where: torch.Tensor  # the positions of the row's new tokens (nodes at chain end + depth)


class BatchLlama(LlamaWeights):
    """A plain Llama model (see `specdec.llama.supports`) with one KV cache per slot.

    Each slot's cache is its own buffer (L, Hkv, T_s, hd), grown by doubling as its request
    grows and freed when the request leaves (`free`): one long request costs the memory of
    its own positions, never every slot's, and memory comes back when it ends. Each row
    attends over its own buffer through `exact_attention` (as one-token steps attend), so a
    row's scores never depend on the rows beside it."""

    INITIAL_CAPACITY = 256  # KV positions a slot allocates at first; grows by doubling
    offers_hidden = True  # forward_features: the hidden states the head reads

    def __init__(self, model: Any, name: str, slots: int, vocab_size: int | None = None, int8: bool = False,
                 act_dtype: torch.dtype = torch.float32, kv_dtype: str | torch.dtype | None = None) -> None:
        """int8: a compressed copy to draft with (see `LlamaWeights`); kv_dtype: see `kv_dtype_for`."""
        super().__init__(model, name, vocab_size, int4=not int8, int8=int8, act_dtype=act_dtype)
        self.slots = slots
        self.k_slots: list[torch.Tensor | None] = [None] * slots  # per slot (L, Hkv, T_s, hd), or None: free
        self.v_slots: list[torch.Tensor | None] = [None] * slots
        self.forward_calls = 0
        self.freed_bytes, self.freed_large = 0, False  # freed since the heap was last trimmed (trim_due)
        # In bfloat16 each row's scored tokens attend one by one, so a row
        # scores exactly what the same request alone (or plain decoding) would. In float32 too
        # where specdec's float32 kernel runs the products (`qgemm.f32_product`: a row's bits
        # whatever shares the product, up to `qgemm.f32_rows()` rows a product).
        self.exact_rows = self.bucket_rows or self.f32_rows_exact()
        # Leading (prompt) queries attend in chunks of this many positions, aligned to it
        self.attention_chunk = PREFILL_CHUNK
        self.kv_dtype = kv_dtype_for(self, kv_dtype)  # what the slots' caches hold (float16 for a 4-bit target)

    def f32_rows_exact(self) -> bool:
        """Whether this model's products are float32 ones on specdec's row-invariant kernel (float32
        weights on the CPU, the extension built), so that scored rows attending alone compute
        exactly what one-token steps do."""
        return (self.embed.device.type == "cpu" and self.embed.dtype == torch.float32 and not self.int4
                and not self.int8 and qgemm.f32_rows() > 0)

    def view(self, slots: int) -> BatchLlama:
        """Another model of `slots` slots over the same (fused, possibly quantized) weights,
        its caches empty: nothing is read, fused or quantized again."""
        other = copy.copy(self)
        other.slots, other.forward_calls, other.freed_bytes, other.freed_large = slots, 0, 0, False
        other.k_slots, other.v_slots = [None] * slots, [None] * slots
        return other

    def embeddings(self) -> Any:
        """The input embedding table: float (V, D), or a GGUF file's Q8_0 rows (`int4.BlockEmbedding`)."""
        return self.embed

    def head(self) -> torch.Tensor:
        """The head's float weights (V, D) (with 4-bit weights, those transformers de-quantized)."""
        if isinstance(self.lm_head, torch.Tensor):
            return self.lm_head
        return self.model.lm_head.weight[: self.vocab_size]  # type: ignore[no-any-return]

    def position_bytes(self) -> int:
        """Bytes of keys and values one position of one slot holds (all layers)."""
        return 2 * len(self.layers) * self.n_kv * self.head_dim * self.kv_dtype.itemsize

    def capacity_for(self, positions: int) -> int:
        """Positions a slot's buffer holds once its request reaches `positions`: doubling from
        the initial capacity, at most the context (what the server's admission reserves)."""
        return grown_capacity(positions, self.INITIAL_CAPACITY, self.max_length)

    def kv_bytes(self) -> int:
        """Bytes the slots' caches hold now."""
        return sum(self.position_bytes() * k.shape[2] for k in self.k_slots if k is not None)

    def free(self, slot: int) -> None:
        """Drop a slot's cache (its request has left); `trim_due` says when the freed memory should
        go back to the system too (the C allocator keeps freed heap memory for reuse unless asked)."""
        k = self.k_slots[slot]
        self.k_slots[slot] = self.v_slots[slot] = None
        if k is not None and k.device.type == "cpu":
            size = 2 * k.numel() * k.element_size()
            self.freed_bytes += size
            self.freed_large |= size >= TRIM_BYTES

    def trim_due(self) -> bool:
        """Whether to trim the heap now (then the count starts again): a slot of TRIM_BYTES or more
        was freed (a long request), or TRIM_BYTES were in all and no slot is in use any more (a burst
        of requests over: 64 chat streams left ~400 MiB in the heap). While other slots run, small
        freed caches stay for the next requests to reuse. Called by the engine once a request's
        whole state (its prophets' too) is dropped, so that what they held goes back with it."""
        due = self.freed_large or (self.freed_bytes >= TRIM_BYTES and all(k is None for k in self.k_slots))
        if due:
            self.freed_bytes, self.freed_large = 0, False
        return due

    def slot_kv(self, slot: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """A slot's keys and values (layers, kv heads, capacity, head dim), or None when free
        (positions past its request's committed length are stale)."""
        k, v = self.k_slots[slot], self.v_slots[slot]
        return None if k is None or v is None else (k, v)

    def load_prefix(self, slot: int, blocks: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> int:
        """Write blocks of keys and values ((layers, kv heads, n, head dim) each, in order) at
        positions 0.. of a slot (`specdec.prefix`). Returns the positions written."""
        end = sum(k.shape[2] for k, _ in blocks)
        k_slot, v_slot = self.reserve(slot, end)
        at = 0
        for k, v in blocks:
            n = k.shape[2]
            k_slot[:, :, at : at + n] = k
            v_slot[:, :, at : at + n] = v
            at += n
        return end

    def reserve(self, slot: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Room for positions [0, end) in a slot: grow by doubling, keep what is written."""
        k_old, v_old = self.k_slots[slot], self.v_slots[slot]
        capacity = 0 if k_old is None else k_old.shape[2]
        if k_old is not None and v_old is not None and end <= capacity:
            return k_old, v_old
        size = self.capacity_for(end)
        shape = (len(self.layers), self.n_kv, size, self.head_dim)
        k = torch.zeros(shape, dtype=self.kv_dtype, device=self.embed.device)
        v = torch.zeros_like(k)
        if k_old is not None and v_old is not None:
            k[:, :, :capacity], v[:, :, :capacity] = k_old, v_old
        self.k_slots[slot], self.v_slots[slot] = k, v
        return k, v

    def scores(self, i: int) -> Scores | None:
        """Layer i's attention where it is not Llama's (`Scores`), else None."""
        arch = self.arch
        window = arch.window(i)
        if arch.query_scale is None and arch.attn_softcap is None and window is None:
            return None
        return Scores(arch.query_scale or 0.0, arch.attn_softcap, window)

    def _attention(self, i: int, h: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                   rows: Sequence[tuple[torch.Tensor, torch.Tensor, int, int, int, _Tree | None]]) -> torch.Tensor:
        """h (B, n, D); rope: cos and sin_signed at its positions (B, 1, n, hd), gathered once
        per pass; rows: per row (its slot's keys, values, start, new
        tokens, scored tokens, token tree or None). Each row writes its new keys/values by
        position into its own slot (entries past its committed length are stale, overwritten
        later) and attends over them alone: causally, or (a token tree) as its mask allows.
        Families add biases, norms of each head of q and k (before rotary), and a norm of the output."""
        n_rows, n, hd = h.shape[0], h.shape[1], self.head_dim
        w = self.layers[i]
        qkv = self.matmul(h, w["qkv"])
        if "qkv_bias" in w:
            qkv = qkv + w["qkv_bias"]
        if "q_norm" in w:  # each head of q and k normalized over its hd values (in place: qkv is this pass's own)
            split = qkv.view(n_rows, n, -1, hd)
            split[:, :, : self.n_heads] = self.rms_norm(split[:, :, : self.n_heads], w["q_norm"])
            split[:, :, self.n_heads : self.n_heads + self.n_kv] = self.rms_norm(
                split[:, :, self.n_heads : self.n_heads + self.n_kv], w["k_norm"])
        heads = qkv.view(n_rows, n, -1, hd).transpose(1, 2)  # (B, Hq + 2 Hkv, n, hd)
        qk = self.rotate(heads[:, : self.n_heads + self.n_kv], *rope)  # queries and keys rotated at once
        q, k = qk[:, : self.n_heads], qk[:, self.n_heads :]  # (B, Hq, n, hd), (B, Hkv, n, hd)
        v = heads[:, self.n_heads + self.n_kv :]  # (B, Hkv, n, hd)
        gqa = self.n_kv != self.n_heads
        scores = self.scores(i)
        # (B, Hq, n, hd); padded queries stay 0 and are discarded. A row alone (a request stepped
        # by itself) has no padding: its attention is the output, nothing to fill or copy.
        out = torch.zeros_like(q) if n_rows > 1 else None
        for b, (keys, values, start, n_new, scored, tree) in enumerate(rows):
            keys[i, :, start : start + n_new] = k[b, :, :n_new]
            values[i, :, start : start + n_new] = v[b, :, :n_new]
            if tree is not None and self.exact_rows:  # each scored query as a one-token step attends
                one = self._tree_attention(q[b : b + 1, :, :n_new], keys[i][None], values[i][None], start,
                                           tree.node_keys, gqa, scores)
            elif tree is not None and scores is not None:
                end = start + n_new
                one = scored_attention(q[b : b + 1, :, :n_new], keys[i][None], values[i][None], start, end, scores,
                                       gqa, positions=tree.where,
                                       key_positions=torch.cat([torch.arange(start, device=q.device), tree.where]),
                                       mask=tree.mask)
            elif tree is not None:  # a token tree: each node sees the context, the chain and its ancestors
                end = start + n_new
                one = F.scaled_dot_product_attention(q[b : b + 1, :, :n_new], keys[i][None, :, :end].to(q.dtype),
                                                     values[i][None, :, :end].to(q.dtype), attn_mask=tree.mask,
                                                     enable_gqa=gqa)
            else:
                solo = min(scored, n_new) if self.exact_rows and n_new > 1 else 0
                one = exact_attention(q[b : b + 1, :, :n_new], keys[i][None], values[i][None], start, solo, gqa,
                                      self.attention_chunk, scores)
            if out is None:
                out = one
            else:
                out[b : b + 1, :, :n_new] = one
        assert out is not None
        out = self.matmul(out.transpose(1, 2).reshape(n_rows, n, self.n_heads * hd), w["o"])  # (B, n, D)
        return self.rms_norm(out, w["attn_out_norm"]) if "attn_out_norm" in w else out

    def _tree_attention(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int,
                        node_keys: Sequence[torch.Tensor], gqa: bool, scores: Scores | None = None) -> torch.Tensor:
        """A chain then a token tree, attended so that each scored query computes exactly what a
        one-token step at its place would: the chain through `exact_attention` (its last query
        alone), and each node alone over the keys it sees (`node_keys`), gathered in order
        (context, chain, its ancestors, itself) as one contiguous sequence. In bfloat16 (and
        with 4-bit products) a tree row then scores what plain decoding scores; attending node
        by node costs 1.5-2.5x the masked pass at 200-800 positions (int4 SmolLM2; on this AMD
        EPYC with avx512_bf16 the masked pass rounds some rows differently)."""
        chain = q.shape[2] - len(node_keys)
        parts = [exact_attention(q[:, :, :chain], keys, values, start, 1, gqa, self.attention_chunk, scores)]
        # (a node's keys gathered are at positions 0.. in order, so a window applies to them as to a step's)
        parts += [one_query(q[:, :, j : j + 1], keys[:, :, idx], values[:, :, idx], len(idx), gqa, scores)
                  for j, idx in enumerate(node_keys, chain)]
        return torch.cat(parts, dim=2)

    @torch.inference_mode()
    def forward(self, slots: Sequence[int], starts: Sequence[int], new_ids: Sequence[Sequence[int]],
                n_logits: Sequence[int], trees: Sequence[Sequence[int] | None] | None = None) -> torch.Tensor:
        """See `specdec.lm.LM.forward`. Returns float32 logits (B, max(n_logits), V). trees: per row,
        None, or the parents of a token tree (see `specdec.verify.DraftTree`) whose nodes are
        the row's last len(parents) new ids: each node sits at (chain end + its depth) and
        sees only its ancestors (`keep_path` then keeps the accepted ones)."""
        return self.forward_features(slots, starts, new_ids, n_logits, trees=trees)[0]

    @torch.inference_mode()
    def keep_path(self, slot: int, base: int, path: Sequence[int]) -> None:
        """After a tree pass whose nodes sat from position `base` on: move the accepted path's
        entries (node indices, root to leaf) to base, base + 1, ...; the rest are stale. Their
        keys carry the right rotary positions (chain end + depth) already."""
        k, v = self.k_slots[slot], self.v_slots[slot]
        if not path or k is None or v is None or list(path) == list(range(len(path))):
            return
        src = torch.tensor([base + node for node in path], dtype=torch.long, device=k.device)
        k[:, :, base : base + len(path)] = k[:, :, src]
        v[:, :, base : base + len(path)] = v[:, :, src]

    @torch.inference_mode()
    def forward_features(self, slots: Sequence[int], starts: Sequence[int], new_ids: Sequence[Sequence[int]],
                         n_logits: Sequence[int], layers: int | None = None, head: bool = True,
                         trees: Sequence[Sequence[int] | None] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """As `forward`, also returning the hidden states the head read (B, max(n_logits), D),
        after the final norm: the features that feature prophets draft from. layers: only the
        first ones (early exit: the entries they write for these positions are provisional);
        head=False: no logits (an empty (B, m, 0) tensor), the features only."""
        logits, hidden, _ = self.forward_fused(slots, starts, new_ids, n_logits, (), layers, head, trees)
        return logits, hidden

    @torch.inference_mode()
    def forward_fused(self, slots: Sequence[int], starts: Sequence[int], new_ids: Sequence[Sequence[int]],
                      n_logits: Sequence[int], capture: Sequence[int], layers: int | None = None, head: bool = True,
                      trees: Sequence[Sequence[int] | None] | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """As `forward_features`, also returning the outputs of the layers `capture` (the
        residual stream after each) at every new position, concatenated: (B, n, len * D)
        float32 (an eagle3 prophet's fused features), or None when capture is empty."""
        device = self.embed.device
        lens = torch.tensor([len(ids) for ids in new_ids], device=device)  # (B,)
        n, end = int(lens.max()), max(s + len(ids) for s, ids in zip(starts, new_ids, strict=True))
        if end > self.max_length:
            raise ValueError(f"'{self.name}' has a context of {self.max_length} tokens")
        layouts: list[_Tree | None] = [None] * len(slots)
        positions = torch.tensor(list(starts), device=device)[:, None] + torch.arange(n, device=device)  # (B, n)
        # the same layers in C++ where it applies (bit for bit this loop's results, see specdec.layerloop): token
        # trees too where each of their queries attends alone (a verification pass: a chain of one pending token)
        tree_of = {b: list(t) for b, t in enumerate(trees or []) if t}  # rows with a tree: its parents
        in_cpp = not tree_of or (self.exact_rows and not any(self.arch.windows) and all(
            len(new_ids[b]) - len(t) == 1 and n_logits[b] >= len(new_ids[b]) for b, t in tree_of.items()))
        stack = layerloop.stack_for(self) if in_cpp and (layers is None or layers >= 0) else None
        for b, parents in tree_of.items():  # laid out once for every layer: the nodes' positions (chain end + depth),
            start, chain = starts[b], len(new_ids[b]) - len(parents)  # and for this loop the mask and keys
            if stack is not None:  # the C++ loop takes the parents themselves
                ends = [start + chain - 1 + d for d in tree_depths(parents)]
                positions[b, chain : chain + len(parents)] = torch.tensor(ends, device=device)
                continue
            where, allowed = tree_layout(start, chain, parents)
            positions[b, : len(where)] = where.to(device)
            context = torch.arange(start, device=device)
            node_keys = [torch.cat([context, start + allowed[j, start:].nonzero().flatten().to(device)])
                         for j in range(chain, len(where))] if self.exact_rows else []
            layouts[b] = _Tree(allowed.to(device), node_keys, where.to(device))
        rows = [(*self.reserve(int(slot), start + len(ids)), start, len(ids), scored, tree)
                for slot, start, ids, scored, tree in zip(slots, starts, new_ids, n_logits, layouts, strict=True)]
        ids = torch.tensor([list(r) + [0] * (n - len(r)) for r in new_ids], device=device)  # (B, n), padded
        positions = positions.clamp_max(self.max_length - 1)  # padding only; its outputs are discarded
        x = self.embed[ids]  # (B, n, D)
        if self.arch.embed_scale is not None:  # (Gemma: scaled in the embeddings' dtype, as transformers does)
            x = x * torch.tensor(self.arch.embed_scale, dtype=x.dtype)
        kept: list[torch.Tensor] = []
        ropes = {kind: (cos[positions][:, None], sin_signed[positions][:, None])  # (B, 1, n, hd) each
                 for kind, (cos, sin_signed) in self.ropes.items()}
        if stack is not None:  # the rotary tables in `self.ropes`' order (a layer's index into them: layerloop)
            (cos, sin_signed), *more = ropes.values()
            x, kept = stack.run(x, cos, sin_signed, [r[0] for r in rows], [r[1] for r in rows],
                                [int(s) for s in starts], [len(ids) for ids in new_ids], [int(m) for m in n_logits],
                                -1 if layers is None else layers, [int(c) for c in capture],
                                [tree_of.get(b, []) for b in range(len(slots))] if tree_of else [],
                                [c for c, _ in more], [s for _, s in more])
        else:
            for i, w in enumerate(self.layers[:layers]):
                x = x + self._attention(i, self.rms_norm(x, w["in_norm"]), ropes[self.arch.rope(i)], rows)
                x = x + self.mlp(x, w)
                if i in capture:
                    kept.append(x.float())
        self.forward_calls += 1
        fused = torch.cat(kept, dim=-1) if kept else None
        m = max(n_logits)
        if m == 0:
            return torch.zeros(len(slots), 0, self.vocab_size, device=device), x[:, :0], fused
        first = lens - torch.tensor(list(n_logits), device=device)  # (B,) first new token with logits
        pick = (first[:, None] + torch.arange(m, device=device)).clamp(min=0)
        pick = torch.minimum(pick, lens[:, None] - 1)  # (B, m)
        x = x.gather(1, pick[:, :, None].expand(-1, -1, x.shape[-1]))  # (B, m, D)
        hidden = self.rms_norm(x, self.final_norm)
        if not head:
            return hidden.new_zeros(*hidden.shape[:2], 0).float(), hidden.float(), fused
        logits = self.matmul(hidden, self.lm_head).float()
        if self.arch.final_softcap is not None:
            logits = torch.tanh(logits / self.arch.final_softcap) * self.arch.final_softcap
        return logits, hidden.float(), fused
