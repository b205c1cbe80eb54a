"""Omni-modal dialogue: parse the request -> vision and/or audio encoder (whichever media are
present) -> LLM thinker -> router on special tokens -> text, speech (audio decoder) or an image.

`parse` routes to the encoders of the media the request carries (`image`/`audio` inputs: bytes,
`"sample"` for the built-in test picture/sound, or null); `media` gathers what they produced (an
OR-AND trigger: it fires once both encoders finished or were skipped, with either delivered) into
the thinker's `items`/`embeds`, spliced at the prompt's `<|image|>`/`<|audio|>` markers. The
thinker runs as a turn of the session `omni-dialogue`: further runs on the same workers continue
it, and the history's pages — a picture sent in turn 1 included — are served from the KV cache.
The thinker is `smollm2-135m` (real weights; the encoders project into its hidden size); the
encoders, the audio decoder, the diffusion role (here on `tiny-llama`: it shares no KV with the
thinker, so the cheap transformer does) and the VAE are seeded, random weights for testing: no real
ones are to be had offline. `reply` routes on the thinker's special tokens (`<|speech|>`, `<|image_gen|>`) or the request's
wording to the speech branch (audio decoder -> WAV) and/or the image branch (diffusion -> VAE ->
PNG); `save` writes text, PNG and WAV under `./omniflow-out/<run_id>/` and outputs where.
"""

from __future__ import annotations

from engine.flow.dsl import Workflow
from workflows.ops.common import (
    SAMPLE,
    combine_media,
    draw_prompt,
    parse_request,
    picture,
    prompt_text,
    route_reply,
    save_outputs,
    sound,
    speech_codes,
)

MODEL = "smollm2-135m"
DIFFUSION_MODEL = "tiny-llama"
PAGE_SIZE = 16
SESSION = "omni-dialogue"

wf = Workflow("omni_dialogue", description="omni-modal dialogue: encoders -> thinker -> text, speech or image")
py = wf.role("py", kind="python")
llm = wf.role("thinker", kind="llm", model=MODEL, params={"page_size": PAGE_SIZE})
vision = wf.role("vision", kind="vision_encoder", model="tiny-vit", params={"llm": MODEL})
hearing = wf.role("hearing", kind="audio_encoder", model="tiny-audio-encoder", params={"llm": MODEL})
speech = wf.role("speech", kind="audio_decoder", model="tiny-audio-decoder")
diffusion = wf.role("diffusion", kind="diffusion", model=DIFFUSION_MODEL, params={"page_size": PAGE_SIZE, "steps": 12})
vae = wf.role("vae", kind="vae_decoder", model="tiny-vae")

message = wf.input("message", "text", default="Describe the picture and the sound, say it aloud, and draw a variation.")
image = wf.input("image", "json", default=SAMPLE)
audio = wf.input("audio", "json", default=SAMPLE)
parse = wf.python(parse_request, role=py, id="parse", routes=["picture", "sound", "prompt_text"])
pic = wf.python(picture, role=py, outputs={"out": "image"})
snd = wf.python(sound, role=py, outputs={"out": "audio"})
see = wf.node("see", "vision_encode", role=vision)
hear = wf.node("hear", "audio_encode", role=hearing)
media = wf.python(combine_media, role=py, id="media",
                  inputs={"image_item": {"type": "json", "optional": True},
                          "image_embeds": {"type": "tensor", "optional": True},
                          "audio_item": {"type": "json", "optional": True},
                          "audio_embeds": {"type": "tensor", "optional": True}},
                  outputs={"items": "json", "embeds": "tensor"}, trigger=[["see", "hear"]])
text = wf.python(prompt_text, role=py, outputs={"out": "text"})
think = wf.node("think", "llm", role=llm, params={"max_new_tokens": 16, "seed": 3, "session": SESSION},
                trigger=[["prompt_text", "media"]])
reply = wf.python(route_reply, role=py, id="reply", inputs={"message": "text", "text": "text", "tokens": "tokens"},
                  routes=["speech_codes", "draw_prompt"], outputs={"out": "tokens"})
codes = wf.python(speech_codes, role=py, inputs={"tokens": "tokens"}, outputs={"out": "tokens"})
say = wf.node("say", "audio_decode", role=speech)
draw = wf.python(draw_prompt, role=py, inputs={"tokens": "tokens"}, outputs={"out": "text"})
denoise = wf.node("denoise", "diffusion", role=diffusion, params={"seed": 0})
paint = wf.node("paint", "vae_decode", role=vae)
save = wf.python(save_outputs, role=py, id="save", inputs={"text": "text", "image": {"type": "image", "optional": True},
                                                           "audio": {"type": "audio", "optional": True}})

wf.edge(message, parse.inp("message"))
wf.edge(image, parse.inp("image"))
wf.edge(audio, parse.inp("audio"))
wf.edge(parse, pic)
wf.edge(parse, snd)
wf.edge(parse, text)
wf.edge(pic, see.inp("image"))
wf.edge(snd, hear.inp("audio"))
wf.edge(see.out("item"), media.inp("image_item"))
wf.edge(see.out("embeds"), media.inp("image_embeds"))
wf.edge(hear.out("item"), media.inp("audio_item"))
wf.edge(hear.out("embeds"), media.inp("audio_embeds"))
wf.edge(text, think.inp("prompt"))
wf.edge(media.out("items"), think.inp("items"))
wf.edge(media.out("embeds"), think.inp("embeds"))
wf.edge(message, reply.inp("message"))
wf.edge(think.out("text"), reply.inp("text"))
wf.edge(think.out("tokens"), reply.inp("tokens"))
wf.edge(reply, codes)
wf.edge(reply, draw)
wf.edge(codes, say.inp("codes"))
wf.edge(draw, denoise.inp("prompt"))
wf.edge(denoise.out("latents"), paint.inp("latents"))
wf.edge(think.out("text"), save.inp("text"))
wf.edge(say.out("audio"), save.inp("audio"))
wf.edge(paint.out("image"), save.inp("image"))
wf.output("saved", save, "json")
wf.output("reply_text", think.out("text"), "text")
wf.output("kv", think.out("kv"), "kv")

workflow = wf
