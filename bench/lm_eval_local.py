"""Run lm-eval-harness against a running `kvmesh serve` through its `local-completions` model
(OpenAI completions with echo + logprobs for loglikelihood, plain completions for generate_until),
on the two small tasks shipped in tests/data/lm_eval (no download):

    pip install -e '.[eval]'
    kvmesh serve &                      # the default model, http://127.0.0.1:8000
    python bench/lm_eval_local.py --base-url http://127.0.0.1:8000 \
        --tokenizer ~/.cache/kvmesh/models/smollm2-135m-instruct-*/

Prints lm-eval's results table and writes its results JSON to --output (default: stdout only).
The tokenizer directory must hold the served model's tokenizer (lm-eval tokenizes the prompts and
sends token ids, so context lengths are exact).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import yaml

TASK_DIR = Path(__file__).resolve().parents[1] / "tests" / "data" / "lm_eval"
TASKS = ["kvmesh_capitals", "kvmesh_addition"]


def write_tasks(into: Path) -> None:
    """The shipped task YAMLs with their data files made absolute (lm-eval reads them from
    wherever it runs)."""
    for name in TASKS:
        config = yaml.safe_load((TASK_DIR / f"{name}.yaml").read_text())
        files = config["dataset_kwargs"]["data_files"]
        config["dataset_kwargs"]["data_files"] = {k: str(TASK_DIR / v) for k, v in files.items()}
        (into / f"{name}.yaml").write_text(yaml.safe_dump(config))


def run(base_url: str, tokenizer: str, model: str, limit: int | None = None) -> dict:
    import lm_eval
    from lm_eval.tasks import TaskManager

    with tempfile.TemporaryDirectory(prefix="kvmesh-lm-eval-") as tmp:
        write_tasks(Path(tmp))
        model_args = (f"model={model},base_url={base_url.rstrip('/')}/v1/completions,"
                      f"tokenizer_backend=huggingface,tokenizer={tokenizer},"
                      "num_concurrent=1,max_retries=1,tokenized_requests=True")
        return lm_eval.simple_evaluate(
            model="local-completions", model_args=model_args, tasks=TASKS,
            task_manager=TaskManager(include_path=tmp, include_defaults=False),
            limit=limit, batch_size=1, log_samples=False)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", required=True, help="the server, e.g. http://127.0.0.1:8000")
    parser.add_argument("--tokenizer", required=True, help="directory of the served model's tokenizer")
    parser.add_argument("--model", default="smollm2-135m-instruct", help="the served model's name")
    parser.add_argument("--limit", type=int, default=None, help="documents per task (default: all)")
    parser.add_argument("--output", default=None, help="write the results (JSON) here")
    args = parser.parse_args(argv)
    results = run(args.base_url, args.tokenizer, args.model, args.limit)
    from lm_eval.utils import make_table

    print(make_table(results))
    summary = {"results": results["results"], "versions": results.get("versions"),
               "n-samples": results.get("n-samples")}
    if args.output:
        Path(args.output).write_text(json.dumps(summary, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
