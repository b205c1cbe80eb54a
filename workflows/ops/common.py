"""Python ops shared by the example workflows: prompts, routing on special tokens, saving outputs.

`save_outputs` (op `workflows.ops.common:save_outputs`) writes a run's media under `./omniflow-out/<run_id>/` (gitignored; the node
param `out_dir` moves it) and returns where, so `omniflow run` prints the paths.
"""

from __future__ import annotations

import io
import json
import re
from pathlib import Path
from typing import Any

from engine.spec.calls import NodeContext

SIZE_TOKEN = re.compile(r"<\|size:(\d{2,4})x(\d{2,4})\|>")
DEFAULT_SIZE = (256, 256)


def rewrite_prompt(request: str) -> str:
    """The LLM's instruction: rewrite the request as an image prompt and end with a size token."""
    return ("Rewrite the request as a detailed image prompt, then emit its size as <|size:WxH|>.\n"
            f"Request: {request.strip()}\nImage prompt:")


def context_tokens(prompt: str, tokens: list[int]) -> list[int]:
    """The LLM's whole context as model ids (its prompt tokenized as the llm role does, then what it
    generated): the diffusion role attends to it, reusing the pages the LLM computed."""
    from engine.compute.models.tokenizer import build_byte_tokenizer

    return list(build_byte_tokenizer()(prompt).input_ids) + [int(t) for t in tokens]


def image_size(text: str) -> dict[str, int]:
    """The size the LLM asked for with `<|size:WxH|>` (clamped to 64..1024), else 256x256."""
    match = SIZE_TOKEN.search(text or "")
    width, height = (int(match[1]), int(match[2])) if match else DEFAULT_SIZE
    return {"width": min(max(width, 64), 1024), "height": min(max(height, 64), 1024)}


def save_outputs(ctx: NodeContext, text: str | None = None, image: Any = None, audio: Any = None,
                 size: Any = None, out_dir: str = "omniflow-out") -> dict[str, Any]:
    """Write what arrived (text -> reply.txt, image PNG -> image.png, resized to `size` when given,
    audio WAV -> speech.wav) under `<out_dir>/<run_id>/`; returns the folder and the files."""
    folder = Path(out_dir) / ctx.run_id
    folder.mkdir(parents=True, exist_ok=True)
    files: dict[str, str] = {}
    if text is not None:
        (folder / "reply.txt").write_text(text if isinstance(text, str) else json.dumps(text))
        files["text"] = str(folder / "reply.txt")
    if image is not None:
        data = bytes(image)
        if isinstance(size, dict) and size:
            from PIL import Image

            with Image.open(io.BytesIO(data)) as picture:
                resized = picture.resize((int(size["width"]), int(size["height"])), Image.Resampling.BICUBIC)
                buffer = io.BytesIO()
                resized.save(buffer, format="PNG")
                data = buffer.getvalue()
        (folder / "image.png").write_bytes(data)
        files["image"] = str(folder / "image.png")
    if audio is not None:
        (folder / "speech.wav").write_bytes(bytes(audio))
        files["audio"] = str(folder / "speech.wav")
    return {"dir": str(folder.resolve()), "files": {k: str(Path(v).resolve()) for k, v in files.items()}}
