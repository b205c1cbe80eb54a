import { describe, expect, it } from "vitest";
import {
  byNode,
  type ClusterNode,
  describeAmounts,
  describeGpus,
  describeReplicaGpus,
  gpusOfWorker,
  nodeOfWorker,
} from "./nodes";

describe("nodes", () => {
  it("groups a placement by node, roles and replicas in order", () => {
    const slots = [
      { role: "llm", replica: 0, node: "b", gpus: [0, 1] },
      { role: "diffusion", replica: 1, node: "a", gpus: [3] },
      { role: "diffusion", replica: 0, node: "a", gpus: [2] },
      { role: "llm", replica: 1, node: "a", gpus: [0, 1] },
    ];
    expect(byNode(slots)).toEqual([
      {
        node: "a",
        roles: [
          { role: "diffusion", replicas: [{ replica: 1, gpus: [3] }, { replica: 0, gpus: [2] }] },
          { role: "llm", replicas: [{ replica: 1, gpus: [0, 1] }] },
        ],
      },
      { node: "b", roles: [{ role: "llm", replicas: [{ replica: 0, gpus: [0, 1] }] }] },
    ]);
  });

  it("says which GPUs each replica would get", () => {
    expect(describeGpus([2])).toBe("GPU 2");
    expect(describeGpus([0, 1])).toBe("GPUs 0, 1");
    expect(describeGpus([])).toBe("");
    expect(
      describeReplicaGpus([
        { replica: 0, gpus: [0] },
        { replica: 1, gpus: [2, 3] },
      ]),
    ).toBe("#1 GPU 0 · #2 GPUs 2, 3");
    expect(describeReplicaGpus([{ replica: 0, gpus: [] }])).toBe("");
  });

  it("maps workers to the GPUs they hold", () => {
    const node = (name: string, workers: { worker_id: string; gpus: number[] }[]) =>
      ({ name, workers }) as unknown as ClusterNode;
    const map = gpusOfWorker([node("a", [{ worker_id: "w1", gpus: [1] }, { worker_id: "w2", gpus: [] }])]);
    expect([...map.entries()]).toEqual([["w1", [1]]]);
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
