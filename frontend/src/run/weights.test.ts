import { describe, expect, it } from "vitest";
import type { GraphSpec } from "../api/types";
import { randomWeightRoles } from "./weights";

const spec: GraphSpec = {
  version: 1,
  name: "image_generation",
  roles: [
    { name: "py", kind: "python" },
    { name: "llm", kind: "llm", model: "smollm2-135m" },
    { name: "diffusion", kind: "diffusion", model: "smollm2-135m" },
    { name: "vae", kind: "vae_decoder", model: "tiny-vae" },
  ],
  nodes: [
    { id: "rewrite", kind: "llm", role: "llm" },
    { id: "decode", kind: "vae_decode", role: "vae" },
    { id: "denoise", kind: "diffusion", role: "diffusion" },
    { id: "again", kind: "vae_decode", role: "vae" },
    { id: "save", kind: "python", role: "py" },
  ],
  edges: [],
};

describe("randomWeightRoles", () => {
  it("gives the named roles their model and nodes, in the graph's order", () => {
    expect(randomWeightRoles(spec, ["vae", "diffusion"])).toEqual([
      { role: "diffusion", model: "smollm2-135m", nodes: ["denoise"] },
      { role: "vae", model: "tiny-vae", nodes: ["decode", "again"] },
    ]);
  });

  it("names none where the studio named none", () => {
    expect(randomWeightRoles(spec, [])).toEqual([]);
  });
});
