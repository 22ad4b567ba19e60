"""The exported GGUF in llama.cpp itself: next-token logits against the Hugging Face folder.

    python -m venv .venv-llamacpp && .venv-llamacpp/bin/pip install llama-cpp-python numpy
    python experiments/llamacpp_check.py outputs/demo/final \
        --llamacpp-python .venv-llamacpp/bin/python

For each type (f16, q8_0, q4_1) it exports the folder with ``fedcybgd export``'s code, loads
the file in llama.cpp (through the llama-cpp-python binding, which builds llama.cpp from source
when pip installs it; run in its own interpreter so the project's venv needs none of it), runs
the same token ids as the Hugging Face model, and compares every position's logits: the largest
error over the logits' standard deviation (the measure tests/model/test_export.py bounds for
transformers' own GGUF reader), and how often the two agree on the next token. A greedy
continuation of a chat prompt is printed from each. Figures go to
``experiments/results/llamacpp/`` (``check.json``, ``check.md``).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from fedcybgd.model.export import export_gguf

RESULTS = Path(__file__).resolve().parent / "results" / "llamacpp"
TEXTS = (
    "The film is a quiet triumph: patient, funny and sad at once.",
    "Sally put the marble in the basket and left the room. Anne moved it to the box.",
)
# Run in the llama-cpp-python interpreter: logits of every position for the ids on stdin, and a
# greedy continuation of a prompt (JSON in, JSON out; nothing pickled).
LLAMA_SIDE = r"""
import json, sys
import numpy as np
from llama_cpp import Llama
job = json.load(sys.stdin)
llm = Llama(model_path=job["gguf"], n_ctx=512, logits_all=True, verbose=False, n_threads=2)
out = {"logits": []}
for ids in job["ids"]:
    llm.reset()
    llm.eval(ids)
    out["logits"].append(np.asarray(llm.scores[:len(ids)], dtype=np.float32).tolist())
llm.reset()
text = llm(job["prompt"], max_tokens=24, temperature=0.0)["choices"][0]["text"]
out["continuation"] = text
print(json.dumps(out))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", type=Path, help="a Hugging Face folder, e.g. a run's final/")
    parser.add_argument("--llamacpp-python", required=True,
                        help="a Python interpreter with llama-cpp-python installed")
    parser.add_argument("--types", default="f16,q8_0,q4_1")
    parser.add_argument("--results", type=Path, default=RESULTS)
    args = parser.parse_args()

    tokenizer = AutoTokenizer.from_pretrained(args.folder)
    model = AutoModelForCausalLM.from_pretrained(args.folder, dtype=torch.float32)
    ids = [tokenizer(text).input_ids for text in TEXTS]
    with torch.no_grad():
        want = [model(torch.tensor([row])).logits[0].numpy() for row in ids]
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Name three colours."}], tokenize=False,
        add_generation_prompt=True) if tokenizer.chat_template else TEXTS[0]
    report: dict = {"folder": str(args.folder.resolve()), "tokens": [len(r) for r in ids],
                    "types": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for kind in args.types.split(","):
            gguf = export_gguf(args.folder, Path(tmp) / f"model-{kind}.gguf", kind)
            done = subprocess.run([args.llamacpp_python, "-c", LLAMA_SIDE],
                                  input=json.dumps({"gguf": str(gguf), "ids": ids,
                                                    "prompt": prompt}),
                                  capture_output=True, text=True, check=False, timeout=1800)
            if done.returncode != 0:
                sys.exit(f"llama.cpp failed on {kind}:\n{done.stderr[-3000:]}")
            got = json.loads(done.stdout.strip().splitlines()[-1])
            errors, agree, positions = [], 0, 0
            for w, g in zip(want, got["logits"], strict=True):
                g = np.asarray(g, dtype=np.float32)
                errors.append(float(np.abs(g - w).max() / w.std()))
                agree += int((g.argmax(-1) == w.argmax(-1)).sum())
                positions += len(w)
            report["types"][kind] = {
                "file_mb": round(gguf.stat().st_size / 2**20, 1),
                "max_error_over_std": max(errors),
                "next_token_agreement": agree / positions,
                "continuation": got["continuation"],
            }
            print(kind, json.dumps(report["types"][kind]), flush=True)
    args.results.mkdir(parents=True, exist_ok=True)
    (args.results / "check.json").write_text(json.dumps(report, indent=1) + "\n")
    lines = [f"`{args.folder}` in llama.cpp (llama-cpp-python) against the Hugging Face model, "
             f"{sum(report['tokens'])} positions of {len(TEXTS)} texts.", "",
             "| type | file MB | largest logit error / logit std | next token agrees | "
             "greedy continuation |", "|---|---|---|---|---|"]
    for kind, r in report["types"].items():
        text = r["continuation"].replace("\n", " ").replace("|", "/")
        lines.append(f"| {kind} | {r['file_mb']} | {r['max_error_over_std']:.4f} | "
                     f"{r['next_token_agreement']:.1%} | {text} |")
    (args.results / "check.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
