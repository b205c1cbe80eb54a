import { describe, expect, it } from "vitest";
import type { Refusal } from "../api/nodes";
import { summarizePlacement } from "./placement";

const refusal = (roles: string[], replicas: number[], message: string): Refusal => ({
  role: roles.length === 1 ? roles[0] : roles,
  roles,
  replicas,
  need: { gpus: 0, cpus: 1, memory_gb: 0 },
  labels: {},
  best_node: "a",
  best_free: { gpus: 0, cpus: 0, memory_gb: 16 },
  nodes: [],
  message,
});

describe("a deployment's placement", () => {
  it("is nothing to show for a deployment the studio hosts itself", () => {
    expect(summarizePlacement({})).toBeNull();
    expect(summarizePlacement(null)).toBeNull();
  });

  it("says which replicas moved where and why, newest first, and which wait for a node", () => {
    const summary = summarizePlacement({
      slots: [
        { role: "py", replica: 1, node: "c", gpus: [] },
        { role: "py", replica: 0, node: "c", gpus: [] },
        { role: "vae", replica: 0, node: "a", gpus: [1] },
      ],
      moved: [
        { role: "py", replica: 1, from: null, to: "c", at: "2026-12-05T08:00:00+00:00", reason: "a node has room for it again" },
        { role: "py", replica: 0, from: "a", to: "c", at: "2026-12-05T08:01:00+00:00", reason: "node a lost" },
      ],
      unplaced: [refusal(["llm"], [1, 2], "role 'llm', replicas 1, 2: cannot be placed: each replica needs 1 GPU")],
    });
    expect(summary).not.toBeNull();
    expect(summary?.nodes).toEqual([
      { node: "a", roles: [{ role: "vae", replicas: [{ replica: 0, gpus: [1] }] }] },
      { node: "c", roles: [{ role: "py", replicas: [{ replica: 1, gpus: [] }, { replica: 0, gpus: [] }] }] },
    ]);
    expect(summary?.moves.map(({ replica, from, to, reason }) => [replica, from, to, reason])).toEqual([
      ["py #1", "a", "c", "node a lost"],
      ["py #2", "no node", "c", "a node has room for it again"],
    ]);
    expect(summary?.waiting).toEqual([
      { key: "llm:1,2", replicas: "llm #2, llm #3", reason: "role 'llm', replicas 1, 2: cannot be placed: each replica needs 1 GPU" },
    ]);
  });

  it("is shown while every replica waits, with no node left to run any", () => {
    const summary = summarizePlacement({ slots: [], moved: [], unplaced: [refusal(["a", "b"], [0], "roles 'a', 'b' colocated")] });
    expect(summary?.nodes).toEqual([]);
    expect(summary?.waiting.map((w) => w.replicas)).toEqual(["a #1, b #1"]);
  });
});
