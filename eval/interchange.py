"""Do exported checkpoints run the same elsewhere? For each qlite checkpoint and target: export, import
back (bit-identical?), load in the peer (transformers with compressed-tensors or GPTQModel, llama.cpp
through llama-cpp-python), greedy-decode there, and compare with qlite's reference kernel teacher-
forced on the same tokens: max |logit difference| over the prompt, and the first greedy token where
qlite's argmax differs (with the logit gap there). Peers that are not installed are skipped.

    python -m eval.interchange CKPT... --tokens 32 [--markdown FILE]
"""
from __future__ import annotations

import tempfile
import time
from pathlib import Path

import click
import torch

PROMPT = "<|im_start|>user\nWrite a Python function that checks whether a number is prime.<|im_end|>\n" \
         "<|im_start|>assistant\n"


def qlite_logits(ckpt: Path, ids: list[int]) -> torch.Tensor:
    from qlite.loader import load_model
    model = load_model(ckpt, dtype="float32", kernel="reference")
    with torch.no_grad():
        return model(torch.tensor([ids]))[0].float()  # (T, vocab)


def transformers_run(path: Path, prompt_ids: list[int], n: int) -> tuple[list[int], torch.Tensor]:
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, device_map="cpu").eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=n, do_sample=False, top_k=None, top_p=None,
                             temperature=None)
        new = out[0, len(prompt_ids):].tolist()
        logits = model(torch.tensor([prompt_ids])).logits[0].float()
    return new, logits


def llama_cpp_run(path: Path, prompt_ids: list[int], n: int) -> tuple[list[int], torch.Tensor | None]:
    from llama_cpp import Llama
    llm = Llama(model_path=str(path), n_ctx=len(prompt_ids) + n + 8, n_threads=2, verbose=False)
    new = []
    for tok in llm.generate(prompt_ids, temp=0.0, top_k=1, reset=True):
        if len(new) == n:
            break
        new.append(int(tok))
    return new, None


def compare(ckpt: Path, prompt_ids: list[int], new: list[int], peer_logits: torch.Tensor | None) -> dict:
    ours = qlite_logits(ckpt, prompt_ids + new)
    predicted = ours[len(prompt_ids) - 1:-1].argmax(-1).tolist()
    first = next((i for i, (a, b) in enumerate(zip(predicted, new)) if a != b), None)
    row = {"tokens": len(new), "same_tokens": first is None, "first_divergence": first}
    if first is not None:
        at = ours[len(prompt_ids) - 1 + first]
        row["gap_at_divergence"] = float(at[predicted[first]] - at[new[first]])
    if peer_logits is not None:
        row["max_abs_logit_diff"] = float((ours[:len(prompt_ids)] - peer_logits).abs().max())
    return row


def identical(a: Path, b: Path) -> tuple[int, int]:
    """(tensors equal, tensors compared) between two qlite checkpoints, over the names they share."""
    from qlite.checkpoint import CheckpointDir
    ca, cb = CheckpointDir(a), CheckpointDir(b)
    shared = [n for n in ca.tensors if n in cb.tensors]
    return sum(torch.equal(ca.read(n), cb.read(n)) for n in shared), len(shared)


def run_one(ckpt: Path, target: str, prompt_ids: list[int], n: int, work: Path) -> dict:
    from quantize.interchange import export_checkpoint, import_checkpoint

    out = work / f"{ckpt.name}.{target}" if target != "gguf" else work / f"{ckpt.name}.gguf"
    t0 = time.perf_counter()
    notes = export_checkpoint(ckpt, target, out, progress=False)
    row = {"checkpoint": ckpt.name, "target": target, "export_s": time.perf_counter() - t0, "notes": notes,
           "bytes": sum(f.stat().st_size for f in out.rglob("*")) if out.is_dir() else out.stat().st_size}
    if target != "gguf":
        back = work / f"{out.name}.back"
        import_checkpoint(out, back, progress=False)
        row["round_trip_equal"], row["round_trip_tensors"] = identical(ckpt, back)
    try:
        new, logits = (llama_cpp_run if target == "gguf" else transformers_run)(out, prompt_ids, n)
    except Exception as e:  # a peer that cannot load it: say so in the table
        row["peer_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
        return row
    # against the weights the peer ran: the imported copy (GPTQ's lm_head is float16), or ours for GGUF
    row.update(compare(ckpt if target == "gguf" else back, prompt_ids, new, logits))
    return row


def markdown(rows: list[dict]) -> str:
    peers = {"compressed-tensors": "transformers + compressed-tensors", "gptq": "transformers + GPTQModel",
             "gguf": "llama.cpp (llama-cpp-python)"}
    lines = ["| checkpoint | to | MiB | export s | round trip (import) | runs in | max abs logit diff (prompt) | "
             "greedy tokens vs qlite |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        trip = f"{r['round_trip_equal']}/{r['round_trip_tensors']} equal" if "round_trip_tensors" in r else "-"
        if "peer_error" in r:
            peer, diff, greedy = f"{peers[r['target']]}: fails ({r['peer_error'][:60]}...)", "-", "-"
        else:
            peer = peers[r["target"]]
            diff = f"{r['max_abs_logit_diff']:.2e}" if "max_abs_logit_diff" in r else "-"
            greedy = (f"{r['tokens']}/{r['tokens']} same" if r["same_tokens"] else
                      f"first differs at {r['first_divergence']} (qlite's logit gap {r['gap_at_divergence']:.3f})")
        lines.append(f"| {r['checkpoint']} | {r['target']} | {r['bytes'] / 2 ** 20:.0f} | {r['export_s']:.1f} | {trip} "
                     f"| {peer} | {diff} | {greedy} |")
    return "\n".join(lines)


@click.command()
@click.argument("checkpoints", nargs=-1, required=True, type=click.Path(exists=True, path_type=Path))
@click.option("--to", "targets", default="compressed-tensors,gptq,gguf", show_default=True)
@click.option("--tokens", default=32, show_default=True, help="greedy tokens generated by each peer")
@click.option("--markdown", "md_path", type=click.Path(path_type=Path))
def main(checkpoints, targets, tokens, md_path):
    from qlite.tokenizer import Tokenizer
    torch.set_num_threads(2)
    rows = []
    with tempfile.TemporaryDirectory() as work:
        for ckpt in checkpoints:
            prompt_ids = Tokenizer(ckpt).encode(PROMPT)
            for target in targets.split(","):
                row = run_one(ckpt, target, prompt_ids, tokens, Path(work))
                click.echo(row, err=True)
                rows.append(row)
    table = markdown(rows)
    click.echo(table)
    if md_path:
        md_path.write_text(table + "\n")


if __name__ == "__main__":
    main()
