"""Publishing a drafter on the Hugging Face Hub (``mlx-redrafter upload``).

The folder uploaded holds the drafter's files, its META (so that the tools
of whoever fetches it find it for the model it was made for) and a model
card (``README.md``) written from META: the base model and its fingerprint,
the data, the recipe, the held-out acceptance and the verdict's speed with
the device it was measured on. The upload is ``huggingface_hub``'s
``HfApi.create_repo`` + ``upload_folder``, as ``mlx_lm.convert
--upload-repo`` publishes a model. A drafter trained on the user's own
conversations (META ``data.private``) is refused unless asked for.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import List, Optional

from ..errors import RedrafterError
from ..files import atomic_folder, write_json_atomic, write_text_atomic
from . import store

# What is uploaded besides the card (train_log.jsonl is left out: it names local folders).
UPLOADED = ("config.json", "model.safetensors", "controller.json", "controller.safetensors")
TAGS = ["mlx", "mlx-redrafter", "redrafter", "speculative-decoding", "draft-model"]


def check_publishable(meta: dict, include_private_data: bool) -> None:
    """Refuse a drafter made from the user's own conversations unless asked for."""
    if (meta.get("data") or {}).get("private") and not include_private_data:
        raise RedrafterError(
            "This drafter was trained on your own conversations (the chat/serve history): its weights are "
            "learned from your data, which never leaves this machine unless you say so.",
            "Make one from other prompts (make-drafter --prompts FILE), or pass --include-private-data.",
        )


def _hub_id(text) -> bool:
    return isinstance(text, str) and text.count("/") == 1 and not text.startswith((".", "/", "~"))


def _front_matter(base: dict) -> str:
    from huggingface_hub import ModelCardData

    data = ModelCardData(
        library_name="mlx-redrafter", tags=TAGS, base_model=base.get("id") if _hub_id(base.get("id")) else None
    )
    return f"---\n{data.to_yaml()}\n---\n"


def _base_lines(base: dict) -> List[str]:
    if not base:
        return ["Not recorded (a drafter made by hand)."]
    return [
        f"- model: `{base.get('id', '?')}`",
        f"- fingerprint of the copy it was trained on: `{base.get('fingerprint', '?')}` "
        f"(family `{base.get('family', '?')}`: any copy of the model with the same family fits)",
        f"- hidden size {base.get('hidden_size', '?')}, vocabulary {base.get('vocab_size', '?')}",
    ]


def _data_lines(data: dict) -> List[str]:
    if not data:
        return ["Not recorded."]
    names = {"conversations": "conversations", "positions": "training positions", "tokens": "tokens generated"}
    lines = [
        f"- prompts: {data.get('prompts', '?')}" + (" (the user's own conversations)" if data.get("private") else "")
    ]
    return lines + [f"- {label}: {data[k]:,}" for k, label in names.items() if isinstance(data.get(k), int)]


def _recipe_lines(recipe: dict) -> List[str]:
    if not recipe:
        return ["Not recorded."]
    lines = [f"```bash\n{recipe['command']}\n```"] if recipe.get("command") else []
    for stage, info in (recipe.get("stages") or {}).items():
        lines.append(f"- {stage}: " + ", ".join(f"{k} {v}" for k, v in (info or {}).items()))
    train = recipe.get("train") or {}
    if train:
        lines.append("- training settings: " + ", ".join(f"{k}={v}" for k, v in train.items()))
    return lines or ["Not recorded."]


def _acceptance_lines(acceptance: dict) -> List[str]:
    held = (acceptance or {}).get("held_out") or {}
    if not held:
        return ["Not measured."]
    lines = [f"- positions: {held['positions']:,}"] if isinstance(held.get("positions"), int) else []
    if held.get("by_depth"):
        lines.append("- accepted by depth: " + ", ".join(f"{d}: {a:.2f}" for d, a in enumerate(held["by_depth"], 1)))
    if held.get("tokens_per_step") is not None:
        lines.append(f"- tokens per step: {held['tokens_per_step']:.2f}")
    return lines


def _verdict_lines(v: dict) -> List[str]:
    if not v:
        return ["Not measured."]
    lines = [
        f"Measured on {v.get('device', '?')}, {v.get('date', '?')} (commit {v.get('commit', '?')}), "
        f"{v.get('prompts', '?')} held-out prompts x {v.get('max_tokens', '?')} tokens, greedy:",
        "",
        "| decoding | tokens/s | speed-up | tokens/step |",
        "|---|---|---|---|",
    ]
    plain = v.get("plain") or {}
    lines.append(f"| plain | {plain.get('tokens_per_second', '?')} | 1.00x | 1.00 |")
    for name in ("lookup", "drafter"):
        row = v.get(name) or {}
        if row:
            shape = f" (W={row['beam_width']} L={row['beam_length']})" if "beam_width" in row else ""
            lines.append(
                f"| {name}{shape} | {row.get('tokens_per_second', '')} | {row.get('speedup', '?')}x | "
                f"{row.get('tokens_per_step', '?')} |"
            )
    if "identical" in v:
        lines += ["", f"Output identical to plain decoding: {'yes' if v['identical'] else 'NO'}."]
    if v.get("reason"):
        lines.append(f"Verdict: {v['reason']}.")
    return lines


def model_card(meta: dict, repo: str) -> str:
    """The model card (``README.md``, Hugging Face front matter included) of a drafter with ``meta``."""
    base = meta.get("base_model") or {}
    model = base.get("id", "MODEL")
    sections = [
        (
            f"# {repo}",
            [
                f"A [ReDrafter](https://arxiv.org/abs/2403.09919) draft head for `{model}`, made with "
                "mlx-redrafter (speculative decoding on MLX: the same tokens as the model alone, fewer model "
                "calls)."
            ],
        ),
        (
            "## Use",
            [
                "```bash",
                "pip install mlx-redrafter",
                f"mlx-redrafter chat --model {model} --drafter {repo}",
                "```",
                "",
                'From Python: `load_drafter("' + repo + '")`.',
            ],
        ),
        ("## Base model", _base_lines(base)),
        ("## Data", _data_lines(meta.get("data") or {})),
        ("## Recipe", _recipe_lines(meta.get("recipe") or {})),
        ("## Held-out acceptance", _acceptance_lines(meta.get("acceptance") or {})),
        ("## Speed", _verdict_lines(meta.get("verdict") or {})),
    ]
    body = "\n\n".join(head + "\n\n" + "\n".join(lines) for head, lines in sections)
    return _front_matter(base) + "\n" + body + "\n"


def stage(drafter: Path, repo: str, out: Path, include_private_data: bool = False) -> Path:
    """Write the folder ``upload`` sends for the drafter in ``drafter``: its files, META and the card."""
    drafter = Path(drafter)
    meta = store.read_meta(drafter)
    check_publishable(meta, include_private_data)
    if not (drafter / "model.safetensors").is_file() or not (drafter / "config.json").is_file():
        raise RedrafterError(f"{drafter} is not a drafter folder (config.json + model.safetensors).")
    with atomic_folder(out) as tmp:
        for name in UPLOADED:
            if (drafter / name).is_file():
                shutil.copy2(drafter / name, tmp / name)
        if meta:
            write_json_atomic(tmp / store.META, {k: v for k, v in meta.items() if k != "hub"})
        write_text_atomic(tmp / "README.md", model_card(meta, repo))
    return Path(out)


def upload(folder: Path, repo: str, private: bool = False) -> str:
    """Create ``repo`` (if needed) and upload ``folder`` to it; returns the repo's address."""
    from huggingface_hub import HfApi

    api = HfApi()
    try:
        api.create_repo(repo_id=repo, repo_type="model", private=private, exist_ok=True)
        api.upload_folder(
            folder_path=str(folder),
            repo_id=repo,
            repo_type="model",
            commit_message="Upload a ReDrafter drafter (mlx-redrafter upload)",
        )
    except Exception as e:  # network, authentication, permissions: all the user's to fix
        raise RedrafterError(
            f"Cannot upload to {repo}: {e}",
            "Log in with `hf auth login` (a token with write access), and check the repo id.",
        ) from None
    return f"https://huggingface.co/{repo}"


def publish(
    drafter: Path,
    repo: str,
    *,
    private: bool = False,
    include_private_data: bool = False,
    dry_run: Optional[Path] = None,
) -> str:
    """Stage and upload the drafter (``dry_run``: only stage it there); returns the address or the folder."""
    import tempfile

    if dry_run is not None:
        return str(stage(drafter, repo, dry_run, include_private_data))
    with tempfile.TemporaryDirectory(prefix="redrafter-upload-") as tmp:
        folder = stage(drafter, repo, Path(tmp) / "drafter", include_private_data)
        return upload(folder, repo, private)
