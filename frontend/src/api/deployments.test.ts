import { describe, expect, it } from "vitest";
import type { WorkerSnapshot } from "./cluster";
import { type DeploymentWorker, failureReason, workerRows, workerState } from "./deployments";

function row(over: Partial<DeploymentWorker>): DeploymentWorker {
  return {
    worker_id: "chat-py-0-1", role: "py", replica: 0, rank: 0, host: "127.0.0.1", address: "", device: "cpu", gpus: [],
    pid: 42, status: "starting", error: "", started_at: "2026-12-05T08:00:00Z", last_seen_at: null, live: null,
    ...over,
  };
}

const live: WorkerSnapshot = {
  info: { worker_id: "chat-py-0-1", role: "py", address: "tcp://h:1", capacity: 8, model: null, device: "cpu", host: "h", pid: 42, meta: {} },
  load: { outstanding: 0, queue_depth: 0, busy: false, metrics: {} },
  last_heartbeat: 1,
};

describe("workerState", () => {
  it("a worker row written as its process started is starting, then ready once registered and live", () => {
    expect(workerState(row({}))).toBe("starting");
    expect(workerState(row({ status: "ready", live }))).toBe("ready");
    expect(workerState(row({ status: "ready", live: { ...live, load: { ...live.load, busy: true } } }))).toBe("busy");
  });

  it("a failed worker stays failed, whatever its registry says", () => {
    expect(workerState(row({ status: "failed", replica: null, error: "boom" }))).toBe("failed");
    expect(workerState(row({ status: "failed", replica: null, live }))).toBe("failed");
  });
});

describe("failureReason", () => {
  it("the first line of a failed worker's error; nothing for other states", () => {
    expect(failureReason(row({ status: "failed", error: "\nworker w exited with status 1 before it registered:\nTraceback" })))
      .toBe("worker w exited with status 1 before it registered:");
    expect(failureReason(row({ status: "failed", error: "" }))).toBe("it did not come up (no reason recorded)");
    expect(failureReason(row({ status: "ready", error: "old" }))).toBeNull();
  });
});

describe("workerRows", () => {
  it("a replica with no row yet is a starting placeholder, which the worker's own starting row replaces", () => {
    const before = workerRows([], { py: 1, lm: 1 });
    expect(before.map((r) => [r.role, r.replica, r.status, r.placeholder])).toEqual([
      ["lm", 0, "starting", true],
      ["py", 0, "starting", true],
    ]);
    const after = workerRows([row({})], { py: 1, lm: 1 });
    expect(after.map((r) => [r.role, r.worker_id, r.status, r.placeholder ?? false])).toEqual([
      ["lm", "lm#0", "starting", true],
      ["py", "chat-py-0-1", "starting", false],
    ]);
  });

  it("a failed row (no replica number) does not fill its replica: the placeholder stays beside it", () => {
    const rows = workerRows([row({ status: "failed", replica: null, error: "boom" })], { py: 1 });
    expect(rows.map((r) => [r.worker_id, r.status, r.placeholder ?? false])).toEqual([
      ["py#0", "starting", true],
      ["chat-py-0-1", "failed", false],
    ]);
  });
});
