"""Padding through the real clients, before and after: peak memory and time of
forward+backward when a padded batch reaches the kernels as a dense mask (a 0 / -inf
bias, "before") or as per-sequence lengths (``seqused_k`` / varlen, "after").

JAX (attention only; ``jax.grad`` of the sum of the outputs at the real query rows with
respect to q, k and v, jitted; the lengths are a traced argument), B=2, 16 heads, D=128,
S=8192, bf16, entry 0 keeping all its keys and entry 1 its first 5000:

  a. ``fa_jax.flax.attention_fn`` with a ``nn.make_attention_mask`` boolean (B, 1, S, S)
     mask built inside the jitted function (a tracer: it becomes a dense bias);
  b. ``fa_jax.flax.make_attention_fn(key_value_seq_lengths=lengths)``;
  c. ``fa_jax.dot_product_attention(..., key_value_seq_lengths=lengths)`` (jax.nn's
     contract);
  peers: ``jax.nn.dot_product_attention(..., key_value_seq_lengths=lengths)`` with
  ``implementation="cudnn"`` (GPU only) and ``"xla"``.

  Peak memory is XLA's own account of the compiled fwd+bwd (``memory_analysis()``:
  temporaries + arguments + outputs); time the median of 20 calls after 3 warm-ups; the
  output (forward) and the gradients are compared with case b.

torch + transformers: a training step (forward with labels, backward; no optimizer) of a
Llama built from ``LlamaConfig`` (hidden 1024, 8 heads over 2 K/V heads, head_dim 128,
intermediate 2816, 4 layers, vocab 32000, bf16 weights), B=4, S=4096, left padding of
0, 512, 1024 and 3000 tokens, with ``attn_implementation`` "fa_torch" (padding reaches
the kernels as varlen), "sdpa" (transformers' (B, 1, S, S) mask) and "eager"; and the
same step without padding (fa_torch and sdpa), and with the padded batch's real tokens
packed into one row (``position_ids`` restarting at each sequence, no mask, as
``DataCollatorWithFlattening`` makes them; fa_torch reads the sequences off
transformers' block-causal mask and runs varlen, sdpa takes the (1, 1, T, T) mask). Time: median of 10 steps after 3
warm-ups; peak memory ``torch.cuda.max_memory_allocated`` over those steps (weights and
gradients included); loss and gradients compared with sdpa's. The labels are -100 where
a token or the one before it is padding, so that the loss reads no padded position's
logits (those are each implementation's own: fa_torch gives 0 there, eager uniform
attention).

    python benchmarks/clients.py [--quick] [--only jax|torch] [--out DIR] [--budget S]

``--quick``: tiny shapes in fp32 (the CPU, where the kernels run in Triton's
interpreter: a check of the code paths, whose times mean nothing). Each section runs in
a child process (``--in-process``: not), so that a crash or a hang in one leaves the
other's rows, and every case in a try/except: a case that fails shows its error in its
row. The sections stop by ``--budget`` seconds in all (default 560, under a 10-minute
command limit; 0: no limit; the first may take 60 % of it, the second what is left);
cases a stopped section did not finish say so. The markdown
tables come last on stdout, and into DIR/CLIENTS.md with ``--out DIR``.
"""
from __future__ import annotations

import argparse
import datetime
import gc
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch and jax share the GPU

import fa_kernels  # noqa: E402,F401  (before triton: the interpreter without a GPU)

MIB = 2 ** 20
SECTIONS = ("jax", "torch")


# ------------------------------------------------------------------------------ the cases


def jax_setup(quick: bool) -> dict:
    if quick:
        return dict(batch=2, seqlen=128, heads=2, head_dim=32, lengths=(128, 80),
                    dtype="float32", warmup=1, runs=2)
    return dict(batch=2, seqlen=8192, heads=16, head_dim=128, lengths=(8192, 5000),
                dtype="bfloat16", warmup=3, runs=20)


# (key, path, label), in the table's order; "b" is the reference of the differences.
JAX_CASES = (
    ("a", "before", "Flax `attention_fn`, mask under jit (dense bias)"),
    ("b", "after", "Flax `make_attention_fn(key_value_seq_lengths=lengths)`"),
    ("c", "after", "`fa_jax.dot_product_attention(key_value_seq_lengths=lengths)`"),
    ("cudnn", "peer", "`jax.nn.dot_product_attention(key_value_seq_lengths=lengths, "
                      "implementation=\"cudnn\")`"),
    ("xla", "peer", "`jax.nn.dot_product_attention(key_value_seq_lengths=lengths, "
                    "implementation=\"xla\")`"),
)
JAX_ORDER = ("b", "c", "a", "cudnn", "xla")  # the reference first, the big peers last


def torch_setup(quick: bool) -> dict:
    if quick:
        return dict(model=dict(vocab_size=128, hidden_size=64, intermediate_size=128,
                               num_hidden_layers=2, num_attention_heads=4,
                               num_key_value_heads=2),
                    batch=4, seqlen=64, padding=(0, 8, 16, 40), dtype="float32",
                    warmup=1, runs=2)
    return dict(model=dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816,
                           num_hidden_layers=4, num_attention_heads=8,
                           num_key_value_heads=2),
                batch=4, seqlen=4096, padding=(0, 512, 1024, 3000), dtype="bfloat16",
                warmup=3, runs=10)


# (key, attn_implementation, layout, path), in the table's order.
TORCH_CASES = (
    ("fa_torch-padded", "fa_torch", "padded", "after (varlen)"),
    ("sdpa-padded", "sdpa", "padded", "before (mask)"),
    ("eager-padded", "eager", "padded", "before (mask)"),
    ("fa_torch-full", "fa_torch", "full", "no padding"),
    ("sdpa-full", "sdpa", "full", "no padding"),
    ("fa_torch-packed", "fa_torch", "packed", "after (varlen, read off the mask)"),
    ("sdpa-packed", "sdpa", "packed", "before (block-causal mask)"),
)
LAYOUTS = {"padded": "left padding", "full": "no padding",
           "packed": "the same real tokens packed in one row"}
# sdpa first (the reference of its layout), eager last (the largest, may not fit).
TORCH_ORDER = ("sdpa-padded", "fa_torch-padded", "sdpa-full", "fa_torch-full",
               "sdpa-packed", "fa_torch-packed", "eager-padded")


def expected_keys(section: str) -> list[str]:
    return [c[0] for c in (JAX_CASES if section == "jax" else TORCH_CASES)]


# -------------------------------------------------------------------------------- helpers


def short_error(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".strip().splitlines()
    text = " ".join(line.strip() for line in text[:3])
    return text[:240] + ("…" if len(text) > 240 else "")


def median_ms(call, sync, warmup: int, runs: int) -> float:
    """Median of ``runs`` calls, each timed alone up to its ``sync``, after ``warmup``."""
    for _ in range(warmup):
        sync(call())
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        sync(call())
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


class Emitter:
    """Collects rows (and a line of setup per section); with a rows file, also appends
    each as a JSON line the moment it is known, for the parent process."""

    def __init__(self, rows_file: str | None):
        self.rows, self.meta, self.rows_file = [], {}, rows_file

    def _write(self, record):
        if self.rows_file:
            with open(self.rows_file, "a") as fh:
                fh.write(json.dumps(record) + "\n")

    def row(self, row: dict):
        self.rows.append(row)
        self._write({"row": row})
        shown = {k: v for k, v in row.items() if k not in ("section", "label")}
        print(f"[{row['section']}] {row['label']}: {shown}", file=sys.stderr, flush=True)

    def setup(self, section: str, text: str):
        self.meta[section] = text
        self._write({"meta": section, "text": text})
        print(f"[{section}] {text}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------- JAX


CPU_REMARK = " (Triton's interpreter on the CPU: not a measurement)"


def no_gpu_rows(emit: Emitter, row, keys, on_gpu: bool, quick: bool) -> bool:
    """Without a GPU the full sizes are not run: a row saying so for each case (True)."""
    if on_gpu or quick:
        return False
    for key in keys:
        emit.row(row(key, error="no GPU: the full sizes need one (--quick on the CPU)"))
    return True


def jax_section(quick: bool, emit: Emitter):
    setup = jax_setup(quick)
    cases = {key: (path, label) for key, path, label in JAX_CASES}

    def row(key, **values):
        path, label = cases[key]
        return dict(section="jax", key=key, path=path, label=label, **values)

    try:
        import jax
        import jax.numpy as jnp
        import numpy as np

        import flax
        import flax.linen as nn

        import fa_jax
        import fa_jax.flax
    except Exception as exc:  # noqa: BLE001
        traceback.print_exc()
        for key in JAX_ORDER:
            emit.row(row(key, error=f"import: {short_error(exc)}"))
        return

    on_gpu = jax.default_backend() == "gpu"
    device = jax.devices()[0]
    batch, seqlen, heads, head_dim = (setup[k] for k in ("batch", "seqlen", "heads", "head_dim"))
    dtype = jnp.dtype(setup["dtype"])
    emit.setup("jax", f"jax {jax.__version__}, flax {flax.__version__}, "
                      f"{device.platform}: {getattr(device, 'device_kind', '?')}; "
                      f"B={batch}, S={seqlen} (q_len = kv_len), heads {heads}, "
                      f"D={head_dim}, {setup['dtype']}, key lengths "
                      f"{list(setup['lengths'])}; ms: median of {setup['runs']} calls "
                      f"after {setup['warmup']} warm-ups"
                      + CPU_REMARK * (not on_gpu))
    if no_gpu_rows(emit, row, JAX_ORDER, on_gpu, quick):
        return

    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    shape = (batch, seqlen, heads, head_dim)  # Flax and jax.nn: (batch, length, heads, depth)
    q, k, v = (jax.random.normal(key, shape, jnp.float32).astype(dtype) for key in keys)
    lengths = jnp.asarray(setup["lengths"], jnp.int32)
    real_rows = np.arange(seqlen)[None, :] < np.asarray(setup["lengths"])[:, None]  # (B, S)

    def case_a(q, k, v, lengths):
        key_is_real = jnp.arange(seqlen)[None, :] < lengths[:, None]
        mask = nn.make_attention_mask(jnp.ones((batch, seqlen), bool), key_is_real,
                                      dtype=jnp.bool_)  # (B, 1, S, S), traced
        return fa_jax.flax.attention_fn(q, k, v, mask=mask)

    def case_b(q, k, v, lengths):
        return fa_jax.flax.make_attention_fn(key_value_seq_lengths=lengths)(q, k, v)

    def case_c(q, k, v, lengths):
        return fa_jax.dot_product_attention(q, k, v, key_value_seq_lengths=lengths)

    def peer(implementation):
        def fn(q, k, v, lengths):
            return jax.nn.dot_product_attention(q, k, v, key_value_seq_lengths=lengths,
                                                implementation=implementation)
        return fn

    fns = dict(a=case_a, b=case_b, c=case_c, cudnn=peer("cudnn"), xla=peer("xla"))

    def loss_of(fn):
        def loss(q, k, v, lengths):  # the sum of the outputs at the real query rows
            out = fn(q, k, v, lengths).astype(jnp.float32)
            rows = jnp.arange(seqlen)[None, :] < lengths[:, None]
            return jnp.sum(jnp.where(rows[:, :, None, None], out, 0.0))
        return loss

    args = (q, k, v, lengths)
    reference = {}
    for key in JAX_ORDER:
        result = row(key)
        try:
            if key == "cudnn" and not on_gpu:
                result["note"] = "skipped: cuDNN needs a GPU"
                continue
            fn = fns[key]
            grad = jax.jit(jax.grad(loss_of(fn), argnums=(0, 1, 2))).lower(*args).compile()
            stats = grad.memory_analysis()
            if stats is not None:
                result["temp_mib"] = stats.temp_size_in_bytes / MIB
                result["peak_mib"] = (stats.temp_size_in_bytes + stats.argument_size_in_bytes
                                      + stats.output_size_in_bytes) / MIB
            out = np.asarray(jax.jit(fn)(*args), np.float32)
            grads = [np.asarray(g, np.float32) for g in jax.block_until_ready(grad(*args))]
            if not np.all(np.isfinite(out[real_rows])):
                result["note"] = "non-finite output at real rows"
            if key == "b":
                reference = dict(out=out, grads=grads)
                result["out_diff"] = result["grad_diff"] = 0.0
            elif reference:
                result["out_diff"] = float(np.max(np.abs(out - reference["out"])[real_rows]))
                result["grad_diff"] = max(float(np.max(np.abs(g - r)))
                                          for g, r in zip(grads, reference["grads"]))
            del out, grads
            result["ms"] = median_ms(lambda: grad(*args), jax.block_until_ready,
                                     setup["warmup"], setup["runs"])
        except Exception as exc:  # noqa: BLE001  (the row shows it; the others go on)
            traceback.print_exc()
            result["error"] = short_error(exc)
        finally:
            grad = stats = None
            gc.collect()
            emit.row(result)


# -------------------------------------------------------------------------------- torch


def torch_section(quick: bool, emit: Emitter):
    setup = torch_setup(quick)
    cases = {key: (impl, layout, path) for key, impl, layout, path in TORCH_CASES}

    def row(key, **values):
        impl, layout, path = cases[key]
        label = f"{impl}, {LAYOUTS[layout]}"
        return dict(section="torch", key=key, path=path, label=label, **values)

    try:
        import torch
        import transformers

        import fa_torch.transformers
        fa_torch.transformers.register()
    except Exception as exc:  # noqa: BLE001
        traceback.print_exc()
        for key in TORCH_ORDER:
            emit.row(row(key, error=f"import: {short_error(exc)}"))
        return

    on_gpu = torch.cuda.is_available()
    device = torch.device("cuda" if on_gpu else "cpu")
    dtype = getattr(torch, setup["dtype"])
    batch, seqlen, padding = setup["batch"], setup["seqlen"], setup["padding"]
    m = setup["model"]
    emit.setup("torch", f"torch {torch.__version__}, transformers {transformers.__version__}, "
                        f"{torch.cuda.get_device_name() if on_gpu else 'CPU'}; Llama: "
                        f"hidden {m['hidden_size']}, {m['num_attention_heads']} heads over "
                        f"{m['num_key_value_heads']} K/V heads (head_dim "
                        f"{m['hidden_size'] // m['num_attention_heads']}), intermediate "
                        f"{m['intermediate_size']}, {m['num_hidden_layers']} layers, vocab "
                        f"{m['vocab_size']}, {setup['dtype']} weights; B={batch}, "
                        f"S={seqlen}, left padding {list(padding)}; ms: median of "
                        f"{setup['runs']} steps after {setup['warmup']} warm-ups"
                        + CPU_REMARK * (not on_gpu))
    if no_gpu_rows(emit, row, TORCH_ORDER, on_gpu, quick):
        return

    def sync():
        if on_gpu:
            torch.cuda.synchronize()

    try:
        config = transformers.LlamaConfig(**m, max_position_embeddings=max(seqlen, 2048),
                                          attention_dropout=0.0, tie_word_embeddings=False)
        torch.manual_seed(0)
        with torch.device(device):
            model = transformers.AutoModelForCausalLM.from_config(
                config, attn_implementation="sdpa")
        model = model.to(device=device, dtype=dtype).train()
        weights_mib = sum(p.numel() * p.element_size() for p in model.parameters()) / MIB
        gen = torch.Generator().manual_seed(1)
        ids = torch.randint(0, m["vocab_size"], (batch, seqlen), generator=gen)
        padded_mask = torch.ones(batch, seqlen, dtype=torch.long)
        for b, pad in enumerate(padding):
            padded_mask[b, :pad] = 0
        inputs = {}
        for layout, mask in (("padded", padded_mask), ("full", torch.ones_like(padded_mask))):
            # Labels only where the token and the one before it are real: the causal LM
            # loss predicts label t + 1 from position t, and a padded position's logits
            # are each implementation's own (fa_torch: 0; eager: uniform attention).
            labels = ids.masked_fill(mask == 0, -100)
            labels[:, 1:].masked_fill_(mask[:, :-1] == 0, -100)
            inputs[layout] = dict(
                input_ids=ids.to(device), attention_mask=mask.to(device),
                position_ids=(mask.cumsum(-1) - 1).clamp(min=0).to(device),
                labels=labels.to(device))
        # Packed (DataCollatorWithFlattening): the padded batch's real tokens in one row,
        # position_ids restarting at each sequence, no mask, no label across a boundary.
        real = padded_mask.bool()
        positions = (padded_mask.cumsum(-1) - 1)[real][None]
        packed_labels = ids[real][None].masked_fill(positions == 0, -100)
        inputs["packed"] = dict(input_ids=ids[real][None].to(device),
                                position_ids=positions.to(device),
                                labels=packed_labels.to(device), use_cache=False)
        emit.setup("torch", emit.meta["torch"] + f"; weights {fmt(weights_mib, 'mib')} MiB")
    except Exception as exc:  # noqa: BLE001
        traceback.print_exc()
        for key in TORCH_ORDER:
            emit.row(row(key, error=f"model: {short_error(exc)}"))
        return

    references = {}  # layout -> (loss, {name: grad on the host})
    for key in TORCH_ORDER:
        impl, layout, _ = cases[key]
        result = row(key)
        batch_inputs = inputs[layout]
        try:
            model.set_attn_implementation(impl)
            if model.config._attn_implementation != impl:
                raise RuntimeError(f"the model runs {model.config._attn_implementation!r}")

            def step():
                model.zero_grad(set_to_none=True)
                loss = model(**batch_inputs).loss
                loss.backward()
                return loss.detach()

            for _ in range(setup["warmup"]):
                step()
            sync()
            if on_gpu:
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
            times = []
            for _ in range(setup["runs"]):
                start = time.perf_counter()
                loss = step()
                sync()
                times.append((time.perf_counter() - start) * 1e3)
            result["ms"] = statistics.median(times)
            if on_gpu:
                result["peak_mib"] = torch.cuda.max_memory_allocated() / MIB
            result["loss"] = loss = float(loss)
            if not math.isfinite(loss):
                result["note"] = "non-finite loss"
            grads = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
            if impl == "sdpa":
                references[layout] = (loss, {n: g.detach().float().cpu() for n, g in grads.items()})
                result["loss_diff"] = result["grad_diff"] = 0.0
            elif layout in references:
                ref_loss, ref_grads = references[layout]
                result["loss_diff"] = abs(loss - ref_loss)
                worst = 0.0
                for name, ref in ref_grads.items():
                    got = grads.get(name)
                    if got is None:
                        raise RuntimeError(f"no gradient for {name}")
                    scale = float(ref.abs().max()) or 1.0
                    worst = max(worst, float((got.float().cpu() - ref).abs().max()) / scale)
                result["grad_diff"] = worst
            del grads
        except Exception as exc:  # noqa: BLE001  (an OOM of eager, say: the row shows it)
            traceback.print_exc()
            result["error"] = short_error(exc)
        finally:
            model.zero_grad(set_to_none=True)
            gc.collect()
            if on_gpu:
                torch.cuda.empty_cache()
            emit.row(result)


# ------------------------------------------------------------------------------- tables


def fmt(value, spec: str) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if spec == "mib":  # whole MiB, but three digits for the tiny sizes of --quick
        return format(value, ".0f" if value >= 100 else ".3g")
    return format(value, spec)


def cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def remark(row: dict) -> str:
    parts = [row[k] for k in ("note", "error") if row.get(k)]
    return cell("; ".join(parts)) if parts else ""


def render(rows: list[dict], meta: dict, sections, quick: bool, argv) -> str:
    lines = ["# Padding through the clients: dense mask (before) against lengths (after)\n",
             f"{datetime.date.today().isoformat()}. Command: `python benchmarks/clients.py "
             f"{' '.join(argv)}`."
             + (" `--quick`: tiny shapes, fp32; on the CPU the times are the interpreter's "
                "and mean nothing." if quick else "") + "\n"]
    by_key = {(r["section"], r["key"]): r for r in rows}
    if "jax" in sections:
        lines += ["## JAX: attention alone, jitted fwd+bwd (`jax.grad` w.r.t. q, k, v)\n",
                  meta.get("jax", "(no setup line: the section did not start)") + ".\n",
                  "peak MiB: `compile().memory_analysis()` of the jitted fwd+bwd, "
                  "temp_size + argument_size + output_size (temp MiB: temp_size alone). "
                  "max |Δout|: the forward output against case b over the real (unpadded) "
                  "query rows; max |Δgrad|: dq, dk, dv against case b, every element "
                  "(the loss is the sum of the outputs at the real query rows).\n",
                  "| case | path | peak MiB (temp+arg+out) | temp MiB | ms fwd+bwd "
                  "| max \\|Δout\\| vs b | max \\|Δgrad\\| vs b | note / error |",
                  "|---|---|---|---|---|---|---|---|"]
        for key, path, label in JAX_CASES:
            r = by_key.get(("jax", key), {})
            name = f"{key}. {label}" if len(key) == 1 else f"peer: {label}"
            lines.append(f"| {name} | {path} | {fmt(r.get('peak_mib'), 'mib')} "
                         f"| {fmt(r.get('temp_mib'), 'mib')} | {fmt(r.get('ms'), '.2f')} "
                         f"| {fmt(r.get('out_diff'), '.2e')} | {fmt(r.get('grad_diff'), '.2e')} "
                         f"| {remark(r) if r else 'no result'} |")
        lines.append("")
    if "torch" in sections:
        lines += ["## torch + transformers: Llama training step (forward with labels, "
                  "backward)\n",
                  meta.get("torch", "(no setup line: the section did not start)") + ".\n",
                  "peak MiB: `torch.cuda.max_memory_allocated()` over the timed steps "
                  "(weights and gradients included; n/a on the CPU). |Δloss| and max "
                  "|Δgrad| (over parameters, of max |g - g_sdpa| / max |g_sdpa|) against "
                  "sdpa with the same layout.\n",
                  "| attn_implementation | layout | path | ms / step | peak MiB | loss "
                  "| \\|Δloss\\| vs sdpa | max rel \\|Δgrad\\| vs sdpa | note / error |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for key, impl, layout, path in TORCH_CASES:
            r = by_key.get(("torch", key), {})
            lines.append(f"| {impl} | {LAYOUTS[layout]} | {path} "
                         f"| {fmt(r.get('ms'), '.1f')} | {fmt(r.get('peak_mib'), 'mib')} "
                         f"| {fmt(r.get('loss'), '.6f')} | {fmt(r.get('loss_diff'), '.2e')} "
                         f"| {fmt(r.get('grad_diff'), '.2e')} "
                         f"| {remark(r) if r else 'no result'} |")
        lines.append("")
    return "\n".join(lines)


# --------------------------------------------------------------------------------- main


def run_in_children(args, sections, argv) -> tuple[list[dict], dict]:
    """Each section in a child process (``--only``), its rows read back as they came;
    cases of a child that crashed or ran out of the budget get a row saying so."""
    rows, meta = [], {}
    start = time.monotonic()
    share = 0.6  # of the budget: the most one section may take while another waits
    for i, section in enumerate(sections):
        timeout = None
        if args.budget > 0:
            left = args.budget - (time.monotonic() - start)
            reserve = (1 - share) * args.budget if i < len(sections) - 1 else 0.0
            timeout = max(10.0, left - reserve)  # (what the later sections keep)
        fd, rows_file = tempfile.mkstemp(prefix=f"clients-{section}-", suffix=".jsonl")
        os.close(fd)
        command = [sys.executable, os.path.abspath(__file__), "--only", section,
                   "--rows-file", rows_file] + (["--quick"] if args.quick else [])
        child = subprocess.Popen(command, start_new_session=True)
        failure = None
        try:
            rc = child.wait(timeout=timeout)
            if rc != 0:
                failure = f"the {section} section exited with code {rc} (its stderr above)"
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, 9)  # the child's own process group (it started its compilers)
            child.wait()
            failure = f"not finished: the {section} section was stopped after {timeout:.0f} s " \
                      f"(--budget {args.budget:g})"
        got = []
        with open(rows_file) as fh:
            for line in fh:
                try:
                    record = json.loads(line)
                except ValueError:
                    continue
                if "row" in record:
                    got.append(record["row"])
                elif "meta" in record:
                    meta[record["meta"]] = record["text"]
        os.unlink(rows_file)
        done = {r["key"] for r in got}
        for key in expected_keys(section):
            if key not in done:
                got.append(dict(section=section, key=key, label=key,
                                error=failure or "no result"))
        rows += got
    return rows, meta


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="tiny shapes in fp32 (the CPU: a check of the code paths)")
    parser.add_argument("--only", choices=SECTIONS, help="one section, in this process")
    parser.add_argument("--out", help="also write the tables to DIR/CLIENTS.md")
    parser.add_argument("--budget", type=float, default=560.0,
                        help="seconds for all sections (children stopped after; 0: none)")
    parser.add_argument("--in-process", action="store_true",
                        help="run the sections in this process, not in children")
    parser.add_argument("--rows-file", help=argparse.SUPPRESS)  # a child's rows, for its parent
    args = parser.parse_args()
    argv = [a for a in sys.argv[1:]]
    sections = (args.only,) if args.only else SECTIONS

    if args.only or args.in_process:
        emit = Emitter(args.rows_file)
        for section in sections:
            try:
                (jax_section if section == "jax" else torch_section)(args.quick, emit)
            except Exception as exc:  # noqa: BLE001  (cases catch their own: a last guard)
                traceback.print_exc()
                done = {r["key"] for r in emit.rows if r["section"] == section}
                for key in expected_keys(section):
                    if key not in done:
                        emit.row(dict(section=section, key=key, label=key,
                                      error=short_error(exc)))
        rows, meta = emit.rows, emit.meta
        if args.rows_file:  # a child: the parent prints the tables
            return
    else:
        rows, meta = run_in_children(args, sections, argv)

    table = render(rows, meta, sections, args.quick, argv)
    if args.out:
        try:
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, "CLIENTS.md"), "w") as fh:
                fh.write(table)
        except OSError as exc:
            print(f"could not write {args.out}/CLIENTS.md: {exc}", file=sys.stderr)
    sys.stdout.flush()
    print(table, flush=True)


if __name__ == "__main__":
    main()
