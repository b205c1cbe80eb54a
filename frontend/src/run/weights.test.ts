import { describe, expect, it } from "vitest";
import type { GraphSpec, ModelInfo } from "../api/types";
import { randomWeightRoles } from "./weights";

const model = (name: string, random: boolean, kinds: string[]): ModelInfo => ({
  name,
  source: "builtin",
  random_weights: random,
  label: random ? "random weights (for testing)" : "real weights",
  description: "",
  role_kinds: kinds,
});

const MODELS = [model("smollm2-135m", false, ["llm", "diffusion"]), model("tiny-vae", true, ["vae_decoder"]),
  model("tiny-llama", true, ["llm", "diffusion"])];

const spec: GraphSpec = {
  version: 1,
  name: "image_generation",
  roles: [
    { name: "py", kind: "python" },
    { name: "llm", kind: "llm", model: "smollm2-135m" },
    { name: "vae", kind: "vae_decoder", model: "tiny-vae" },
    { name: "lm2", kind: "llm", model: "tiny-llama" },
    { name: "ckpt", kind: "llm", model: "mine/checkpoint" },
  ],
  nodes: [
    { id: "rewrite", kind: "llm", role: "llm" },
    { id: "decode", kind: "vae_decode", role: "vae" },
    { id: "again", kind: "vae_decode", role: "vae" },
    { id: "chat", kind: "llm", role: "lm2" },
    { id: "save", kind: "python", role: "py" },
  ],
  edges: [],
};

describe("randomWeightRoles", () => {
  it("names the roles on random-weight models with their nodes, and no other", () => {
    expect(randomWeightRoles(spec, MODELS)).toEqual([
      { role: "vae", model: "tiny-vae", nodes: ["decode", "again"] },
      { role: "lm2", model: "tiny-llama", nodes: ["chat"] },
    ]);
  });

  it("claims nothing without the catalogue, or for a model of another kind", () => {
    expect(randomWeightRoles(spec, [])).toEqual([]);
    expect(randomWeightRoles(spec, [model("tiny-vae", true, ["audio_decoder"])])).toEqual([]);
  });
});
