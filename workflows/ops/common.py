"""Python ops shared by the example workflows: prompts, routing on special tokens, saving outputs.

Each is a registered op (`@op`, collected through this package's `omniflow.ops` entry point).
`save_outputs` (op `media.save_outputs`) writes a run's media under `./omniflow-out/<run_id>/` (gitignored; the node
param `out_dir` moves it) and returns where, so `omniflow run` prints the paths.

What a run sends sizes what the media ops make, so each has a declared maximum, checked before
anything is made: media are a file's bytes (or a JSON list of byte values) of at most
`MAX_MEDIA_BYTES`, never a number (`bytes(n)` is n zero bytes), and `save_outputs` resizes to
at most `MAX_SIDE` a side. Anything else fails the node with a `MediaInputError` naming the input.
"""

from __future__ import annotations

import io
import json
import re
from pathlib import Path
from typing import Any

from engine.spec.calls import FinalNodeError, NodeContext
from engine.spec.ops import op

SIZE_TOKEN = re.compile(r"<\|size:(\d{2,4})x(\d{2,4})\|>")
DEFAULT_SIZE = (256, 256)
MAX_SIDE = 4096
"""The widest and tallest `save_outputs` resizes an image to."""
MAX_MEDIA_BYTES = 64 * 1024 * 1024
"""The most bytes a picture or sound the media ops take or write may have."""


class MediaInputError(FinalNodeError, ValueError):
    """A media op's input is not what it takes (trying the node again cannot mend it)."""


def media_bytes(value: Any, where: str, limit: int = MAX_MEDIA_BYTES) -> bytes:
    """`value` as the bytes of a file: bytes, a 1-D uint8 tensor or array (how a worker's bytes
    cross the wire) or a list of byte values, at most `limit` of them; MediaInputError naming
    `where` otherwise. A number is refused, never read as `bytes(n)`."""
    shape = getattr(value, "shape", None)
    if isinstance(value, bytes | bytearray | memoryview):
        length = value.nbytes if isinstance(value, memoryview) else len(value)
    elif shape is not None and len(shape) == 1 and str(getattr(value, "dtype", "")) in ("uint8", "torch.uint8"):
        length = int(shape[0])
    elif isinstance(value, list | tuple):
        length = len(value)
    else:
        kind = "an integer" if isinstance(value, int) else type(value).__name__
        raise MediaInputError(f"{where} must be a file's bytes or a list of byte values, not {kind}")
    if length > limit:
        raise MediaInputError(f"{where}: {length} bytes, over the limit of {limit}")
    if shape is not None:
        return (value.cpu().numpy() if hasattr(value, "cpu") else value).tobytes()
    try:
        return bytes(value)
    except (TypeError, ValueError):
        raise MediaInputError(f"{where} must be a file's bytes or a list of byte values (0 to 255)") from None


def source_pixels_fit(data: bytes) -> None:
    """`MediaInputError` unless `data` is a picture Pillow reads of at most `MAX_IMAGE_PIXELS`
    pixels, judged from its header (`engine.compute.media.image_size`): resizing decodes it whole first."""
    from engine.compute.media import MediaError, image_size

    try:
        image_size(data)
    except MediaError as exc:
        raise MediaInputError(f"image cannot be resized: {exc}") from None


def image_side(size: dict[str, Any], side: str) -> int:
    """`size[side]` (`width` or `height`) as a whole number of pixels, 1 to `MAX_SIDE`."""
    value = size[side]
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_SIDE:
        raise MediaInputError(f"size.{side} must be an integer from 1 to {MAX_SIDE}")
    return value


@op("image.rewrite_prompt")
def rewrite_prompt(request: str) -> str:
    """The LLM's instruction: rewrite the request as an image prompt and end with a size token."""
    return ("Rewrite the request as a detailed image prompt, then emit its size as <|size:WxH|>.\n"
            f"Request: {request.strip()}\nImage prompt:")


@op("image.rewritten_prompt")
def rewritten_prompt(text: str) -> str:
    """The rewrite as a text of its own. The llm node's text is the continuation of
    `rewrite_prompt`'s instruction, which ends on "Image prompt:": its first token carries the space
    that joins it to that colon (byte-level BPE: "ĠA"), as the tokenizer's own decode of prompt and
    continuation together has it. That joint is no part of the rewritten prompt a user reads."""
    return text.strip()


@op("image.context_tokens", inputs={"prompt": "text", "tokens": "tokens"}, outputs={"out": "tokens"})
def context_tokens(prompt: str, tokens: list[int], model: str) -> list[int]:
    """The LLM's whole context as model ids (its prompt tokenized as the llm role running `model`
    does, then what it generated): the diffusion role attends to it, reusing the pages the LLM
    computed. A diffusion node fed the llm node's `kv` does not need it: that value carries these
    ids (`workflows/image_generation.py`); kept for graphs that pass the context as `tokens`."""
    from engine.compute.models.role_tokenizers import RoleTokenizers

    return list(RoleTokenizers().tokenizer(model)(prompt).input_ids) + [int(t) for t in tokens]


@op("image.size")
def image_size(text: str) -> dict[str, int]:
    """The size the LLM asked for with `<|size:WxH|>` (clamped to 64..1024), else 256x256."""
    match = SIZE_TOKEN.search(text or "")
    width, height = (int(match[1]), int(match[2])) if match else DEFAULT_SIZE
    return {"width": min(max(width, 64), 1024), "height": min(max(height, 64), 1024)}


@op("media.save_outputs", inputs={"text": {"type": "text", "optional": True},
                                 "image": {"type": "image", "optional": True},
                                 "audio": {"type": "audio", "optional": True},
                                 "size": {"type": "json", "optional": True}},
    outputs={"out": "json"}, output_dirs=("out_dir",))
def save_outputs(ctx: NodeContext, text: str | None = None, image: Any = None, audio: Any = None,
                 size: Any = None, out_dir: str = "omniflow-out") -> dict[str, Any]:
    """Write what arrived (text -> reply.txt, image PNG -> image.png, resized to `size` when given,
    audio WAV -> speech.wav) under `<out_dir>/<run_id>/`; returns the folder and the files. Image
    and audio are at most `MAX_MEDIA_BYTES`, `size` `{"width", "height"}` at most `MAX_SIDE` a
    side: what does not fit fails the node before anything is written."""
    picture_data = None if image is None else media_bytes(image, "image")
    sound_data = None if audio is None else media_bytes(audio, "audio")
    resize = None
    if size is not None and size != {}:
        if not isinstance(size, dict) or not {"width", "height"} <= set(size):
            raise MediaInputError("size must be an object with an integer width and height")
        resize = (image_side(size, "width"), image_side(size, "height"))
    if resize is not None and picture_data is not None:
        source_pixels_fit(picture_data)
    folder = Path(out_dir) / ctx.run_id
    folder.mkdir(parents=True, exist_ok=True)
    files: dict[str, str] = {}
    if text is not None:
        (folder / "reply.txt").write_text(text if isinstance(text, str) else json.dumps(text))
        files["text"] = str(folder / "reply.txt")
    if picture_data is not None:
        if resize is not None:
            from PIL import Image

            with Image.open(io.BytesIO(picture_data)) as picture:
                resized = picture.resize(resize, Image.Resampling.BICUBIC)
                buffer = io.BytesIO()
                resized.save(buffer, format="PNG")
                picture_data = buffer.getvalue()
        (folder / "image.png").write_bytes(picture_data)
        files["image"] = str(folder / "image.png")
    if sound_data is not None:
        (folder / "speech.wav").write_bytes(sound_data)
        files["audio"] = str(folder / "speech.wav")
    return {"dir": str(folder.resolve()), "files": {k: str(Path(v).resolve()) for k, v in files.items()}}


# -- omni dialogue ------------------------------------------------------------------------------------

SAMPLE = "sample"
"""An `image`/`audio` input of this value means the built-in test picture / sound (`engine.compute.media`)."""
SPEECH_WORDS = re.compile(r"\b(say|speak|aloud|read out|voice)\b", re.IGNORECASE)
DRAW_WORDS = re.compile(r"\b(draw|paint|sketch|picture of|image of)\b", re.IGNORECASE)
SPEECH_TOKEN, IMAGE_TOKEN = "<|speech|>", "<|image_gen|>"


@op("omni.parse_request", inputs={"message": "text", "image": {"type": "json", "optional": True},
                                  "audio": {"type": "json", "optional": True}}, outputs={"out": "json"})
def parse_request(message: str, image: Any = None, audio: Any = None) -> Any:
    """Route to the encoders of the media present (and always to the prompt); the value is the request."""
    from engine.spec.calls import Route

    request = {"message": message, "image": image, "audio": audio}
    return Route([*(["picture"] if image else []), *(["sound"] if audio else []), "prompt_text"], request)


@op("omni.picture", outputs={"out": "image"})
def picture(request: dict) -> bytes:
    """The request's picture as PNG bytes (`"sample"`: the built-in test picture; else its bytes,
    see `media_bytes`)."""
    from engine.compute.media import png_bytes, sample_picture

    image = request["image"]
    return png_bytes(sample_picture()) if isinstance(image, str) and image == SAMPLE else media_bytes(
        image, "request.image")


@op("omni.sound", outputs={"out": "audio"})
def sound(request: dict) -> bytes:
    """The request's audio as WAV bytes (`"sample"`: the built-in test sound; else its bytes, see
    `media_bytes`)."""
    from engine.compute.media import sample_sound, wav_bytes

    audio = request["audio"]
    return wav_bytes(sample_sound()) if isinstance(audio, str) and audio == SAMPLE else media_bytes(
        audio, "request.audio")


@op("omni.prompt_text")
def prompt_text(request: dict) -> str:
    """The thinker's turn in ChatML, SmolLM2's chat format: one `<|image|>`/`<|audio|>` marker per
    medium (where the thinker splices the encoders' embeddings), then the text."""
    markers = ("<|image|>" if request.get("image") else "") + ("<|audio|>" if request.get("audio") else "")
    return f"<|im_start|>user\n{markers}{request['message'].strip()}<|im_end|>\n<|im_start|>assistant\n"


@op("omni.combine_media", inputs={"image_item": {"type": "json", "optional": True},
                                  "image_embeds": {"type": "tensor", "optional": True},
                                  "audio_item": {"type": "json", "optional": True},
                                  "audio_embeds": {"type": "tensor", "optional": True}},
    outputs={"items": "json", "embeds": "tensor"})
def combine_media(image_item: Any = None, image_embeds: Any = None, audio_item: Any = None,
                  audio_embeds: Any = None) -> dict[str, Any]:
    """The encoders' items and embeddings in marker order (image, then audio), rows concatenated."""
    import torch

    items, rows = [], []
    for item, embeds in ((image_item, image_embeds), (audio_item, audio_embeds)):
        if item is not None and embeds is not None:
            items.append(item)
            rows.append(torch.as_tensor(embeds))
    return {"items": items, "embeds": torch.cat(rows).contiguous()}


@op("omni.route_reply", inputs={"message": "text", "text": "text", "tokens": "tokens"}, outputs={"out": "tokens"})
def route_reply(message: str, text: str, tokens: list[int]) -> Any:
    """Router on the thinker's special tokens (or the request's wording): speech, image, text."""
    from engine.spec.calls import Route

    routes = []
    if SPEECH_TOKEN in text or SPEECH_WORDS.search(message):
        routes.append("speech_codes")
    if IMAGE_TOKEN in text or DRAW_WORDS.search(message):
        routes.append("draw_prompt")
    return Route(routes, tokens) if routes else Route([], tokens)


@op("omni.speech_codes")
def speech_codes(tokens: list[int]) -> list[int]:
    """The thinker's tokens as audio codes (a real omni model emits codes above its text vocabulary)."""
    return [int(t) % 1024 for t in tokens] or [0]


@op("omni.draw_prompt", inputs={"tokens": "tokens"})
def draw_prompt(tokens: list[int]) -> str:
    """The image branch's prompt."""
    return "a variation of the picture the user sent, bright colours"
