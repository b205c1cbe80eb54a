import { describe, expect, it } from "vitest";
import type { ModelInfo } from "../api/types";
import { labelFor, randomFor, seededNote } from "./modelWeights";

const smollm2: ModelInfo = {
  name: "smollm2-135m",
  source: "builtin",
  random_weights: false,
  label: "real weights",
  description: "SmolLM2-135M-Instruct",
  role_kinds: ["llm", "diffusion"],
  weights_by_kind: { llm: "real", diffusion: "random" },
};

describe("a model's weights per role kind", () => {
  it("smollm2-135m is real for an llm role and random (its seeded head) for a diffusion one", () => {
    expect(randomFor(smollm2, "llm")).toBe(false);
    expect(labelFor(smollm2, "llm")).toBe("real weights");
    expect(randomFor(smollm2, "diffusion")).toBe(true);
    expect(labelFor(smollm2, "diffusion")).toBe("random weights (for testing)");
    expect(seededNote(smollm2, "diffusion")).toBe(
      "(for a diffusion role: the model's own weights are real, what this role adds to them is seeded)",
    );
    expect(seededNote(smollm2, "llm")).toBeNull();
  });

  it("a checkpoint keeps its label where it is real", () => {
    const ckpt: ModelInfo = { ...smollm2, name: "org/ckpt", source: "checkpoint", label: "checkpoint" };
    expect(labelFor(ckpt, "llm")).toBe("checkpoint");
    expect(labelFor(ckpt, "diffusion")).toBe("random weights (for testing)");
  });

  it("without weights_by_kind (an older studio), the model's own random_weights decides", () => {
    const tiny: ModelInfo = { ...smollm2, name: "tiny-llama", random_weights: true, label: "random weights (for testing)",
                              weights_by_kind: undefined };
    expect(randomFor(tiny, "llm")).toBe(true);
    expect(randomFor({ ...smollm2, weights_by_kind: undefined }, "diffusion")).toBe(false);
  });
});
