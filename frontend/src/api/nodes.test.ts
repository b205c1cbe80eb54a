import { describe, expect, it } from "vitest";
import { byNode, type ClusterNode, describeAmounts, nodeOfWorker } from "./nodes";

describe("nodes", () => {
  it("groups a placement by node, roles and replicas in order", () => {
    const slots = [
      { role: "llm", replica: 0, node: "b" },
      { role: "diffusion", replica: 1, node: "a" },
      { role: "diffusion", replica: 0, node: "a" },
      { role: "llm", replica: 1, node: "a" },
    ];
    expect(byNode(slots)).toEqual([
      { node: "a", roles: [{ role: "diffusion", replicas: [1, 0] }, { role: "llm", replicas: [1] }] },
      { node: "b", roles: [{ role: "llm", replicas: [0] }] },
    ]);
  });

  it("describes amounts for people", () => {
    expect(describeAmounts({ gpus: 1, cpus: 2, memory_gb: 7.5 })).toBe("1 GPU, 2 CPUs, 7.5 GB");
    expect(describeAmounts({ gpus: 0, cpus: 1, memory_gb: 0 })).toBe("0 GPUs, 1 CPU, 0 GB");
  });

  it("maps workers to their node", () => {
    const node = (name: string, ids: string[]) =>
      ({ name, workers: ids.map((worker_id) => ({ worker_id })) }) as unknown as ClusterNode;
    const map = nodeOfWorker([node("a", ["w1", "w2"]), node("b", ["w3"])]);
    expect([...map.entries()]).toEqual([
      ["w1", "a"],
      ["w2", "a"],
      ["w3", "b"],
    ]);
  });
});
