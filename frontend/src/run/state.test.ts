import { describe, expect, it } from "vitest";
import type { RunEvent } from "../api/types";
import events from "./fixtures/stream-events.json";
import { initialRunState, reduceRun, streamText } from "./state";

const all = events as RunEvent[];
const replay = (upTo = all.length) => all.slice(0, upTo).reduce(reduceRun, initialRunState());

describe("reduceRun over a recorded run of workflows/stream.py", () => {
  it("ends with every node done and the run's outputs", () => {
    const s = replay();
    expect(s.status).toBe("done");
    expect(s.lastSeq).toBe(19);
    expect(Object.fromEntries(Object.entries(s.nodes).map(([k, v]) => [k, v.state]))).toEqual({
      text: "done",
      words: "done",
      shout: "done",
      sentence: "done",
      result: "done",
    });
    expect(s.finished?.outputs).toEqual({ result: "HI THERE" });
    expect(s.nodes.words.durationMs).toBeGreaterThan(0);
  });

  it("shows the state at each point of the stream", () => {
    const s = replay(10); // through seq 9: shout running, words done
    expect(s.status).toBe("running");
    expect(s.nodes.words.state).toBe("done");
    expect(s.nodes.shout.state).toBe("running");
    expect(s.nodes.sentence.state).toBe("pending");
    expect(s.streams["words.word"].frames).toEqual(["hi", "there"]);
    expect(s.streams["shout.word"]).toBeUndefined();
  });

  it("gathers frames and final values per port", () => {
    const s = replay();
    expect(s.streams["shout.word"].frames).toEqual(["HI", "THERE"]);
    expect(streamText(s.streams["shout.word"])).toBe("HITHERE");
    expect(s.values["sentence.out"]).toBe("HI THERE");
    expect(s.values["text.value"]).toBe("hi there");
  });

  it("ignores events it has already applied", () => {
    const once = replay();
    const again = all.reduce(reduceRun, once);
    expect(again).toBe(once);
    expect(once.log.map((e) => e.seq)).toEqual(all.map((e) => e.seq));
  });

  it("keeps a node's error and progress", () => {
    let s = initialRunState(["a"]);
    s = reduceRun(s, { type: "node_state", seq: 0, run_id: "r", time: 1, node: "a", state: "running" });
    s = reduceRun(s, { type: "node_progress", seq: 1, run_id: "r", time: 2, node: "a", progress: 0.5, message: "half" });
    expect(s.nodes.a).toMatchObject({ state: "running", progress: 0.5, message: "half", since: 1 });
    s = reduceRun(s, { type: "node_state", seq: 2, run_id: "r", time: 3, node: "a", state: "failed", error: "boom", duration_ms: 2000 });
    s = reduceRun(s, { type: "run_finished", seq: 3, run_id: "r", time: 3, status: "failed", error: "boom", failed_node: "a" });
    expect(s.nodes.a).toMatchObject({ state: "failed", error: "boom", durationMs: 2000 });
    expect(s.status).toBe("failed");
  });

  it("starts over when the run is executed again after its executor stopped", () => {
    const before = replay(10);
    const restart: RunEvent = { type: "run_restarted", seq: 10, run_id: "r", time: 5, attempt: 2,
                                error: "the worker executing this run stopped (lease expired at …)" };
    const s = reduceRun(before, restart);
    expect(s.status).toBe("pending");
    expect(Object.values(s.nodes).every((n) => n.state === "pending")).toBe(true);
    expect(Object.keys(s.nodes).sort()).toEqual(Object.keys(before.nodes).sort());
    expect(s.streams).toEqual({});
    expect(s.values).toEqual({});
    const again = all.map((e) => ({ ...e, seq: e.seq + 11 }) as RunEvent).reduce(reduceRun, s);
    expect(again.status).toBe("done");
    expect(again.streams["shout.word"].frames).toEqual(["HI", "THERE"]);
  });
});
