import { describe, expect, it } from "vitest";
import type { RunEvent } from "../api/types";
import events from "./fixtures/stream-events.json";
import { clockSkew, fileIdsIn, initialRunState, plainLeaves, liveDurationMs, mediaOf, reduceRun, runMedia, streamText, waitingNodes } from "./state";

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

  it("keeps what a queued node waits for (its role's model loading) apart from its progress, until it runs", () => {
    // image_generation on the studio's own engine: the llm role's unit loads smollm2-135m
    let s = initialRunState(["prompt", "rewrite"]);
    s = reduceRun(s, { type: "run_started", seq: 0, run_id: "r", time: 1, workflow: "w", nodes: ["prompt", "rewrite"] });
    s = reduceRun(s, { type: "node_state", seq: 1, run_id: "r", time: 1, node: "rewrite", state: "queued" });
    s = reduceRun(s, { type: "node_progress", seq: 2, run_id: "r", time: 1, node: "rewrite", progress: null, message: "loading smollm2-135m (role llm)" });
    expect(s.nodes.rewrite).toMatchObject({ state: "queued", waiting: "loading smollm2-135m (role llm)" });
    expect(s.nodes.rewrite.message).toBeUndefined();
    expect(waitingNodes(s)).toEqual([{ node: "rewrite", waiting: "loading smollm2-135m (role llm)" }]);
    s = reduceRun(s, { type: "node_state", seq: 3, run_id: "r", time: 9, node: "rewrite", state: "running" });
    expect(s.nodes.rewrite.waiting).toBeUndefined();
    expect(waitingNodes(s)).toEqual([]);
    s = reduceRun(s, { type: "node_progress", seq: 4, run_id: "r", time: 10, node: "rewrite", progress: 0.25, message: "6/24 tokens" });
    expect(s.nodes.rewrite).toMatchObject({ state: "running", progress: 0.25, message: "6/24 tokens" });
    expect(s.nodes.rewrite.waiting).toBeUndefined();
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

describe("watching a run", () => {
  it("says where a node runs and restarts its progress with each attempt", () => {
    let s = initialRunState(["gen"]);
    s = reduceRun(s, { type: "node_state", seq: 0, run_id: "r", time: 10, node: "gen", state: "running", worker: "llm-0", host: "gpu-1" });
    s = reduceRun(s, { type: "node_progress", seq: 1, run_id: "r", time: 11, node: "gen", progress: 0.5, message: "4/8 tokens" });
    expect(s.nodes.gen).toMatchObject({ worker: "llm-0", host: "gpu-1", progress: 0.5, message: "4/8 tokens", since: 10 });
    s = reduceRun(s, { type: "node_state", seq: 2, run_id: "r", time: 12, node: "gen", state: "failed", error: "lost" });
    s = reduceRun(s, { type: "node_state", seq: 3, run_id: "r", time: 13, node: "gen", state: "running", worker: "llm-1", host: "gpu-2" });
    expect(s.nodes.gen).toMatchObject({ worker: "llm-1", host: "gpu-2", progress: null, since: 13 });
  });

  it("counts a looping or retried node's live time on from its earlier runs, up to its final time", () => {
    // As the executor reports a node that ran 2 s in its first iteration, then 3 s in its second.
    let s = initialRunState(["grow"]);
    s = reduceRun(s, { type: "node_state", seq: 0, run_id: "r", time: 100, node: "grow", state: "running", busy_ms: 0 });
    expect(liveDurationMs(s.nodes.grow, 101_500)).toBe(1500);
    s = reduceRun(s, { type: "node_state", seq: 1, run_id: "r", time: 102, node: "grow", state: "done", duration_ms: 2000 });
    expect(liveDurationMs(s.nodes.grow, 103_000)).toBe(2000);
    s = reduceRun(s, { type: "node_state", seq: 2, run_id: "r", time: 104, node: "grow", state: "running", iteration: 2, busy_ms: 2000 });
    // Not back to 0 s: 2 s before, 1 s of this iteration.
    expect(liveDurationMs(s.nodes.grow, 105_000)).toBe(3000);
    expect(liveDurationMs(s.nodes.grow, 107_000)).toBe(5000);
    s = reduceRun(s, { type: "node_state", seq: 3, run_id: "r", time: 107, node: "grow", state: "done", iteration: 2, duration_ms: 5000 });
    expect(liveDurationMs(s.nodes.grow, 200_000)).toBe(5000);
    // A clock read before the attempt's own stamp never counts backwards.
    s = reduceRun(s, { type: "node_state", seq: 4, run_id: "r", time: 110, node: "grow", state: "running", iteration: 3, busy_ms: 5000 });
    expect(liveDurationMs(s.nodes.grow, 109_000)).toBe(5000);
  });

  it("reads the server's clock from event times, so live times are never negative", () => {
    // The browser runs 5 s behind the server: an event stamped 1000.0 s arrives at 995.2 s local.
    const skew = clockSkew(null, [{ time: 1000 }, { time: 999.9 }], 995_200);
    expect(skew).toBeCloseTo(-4800, 6);
    const serverNow = 995_300 - (skew ?? 0);
    expect(serverNow - 1000 * 1000).toBeGreaterThanOrEqual(0);
    // A later, faster arrival tightens it; a replayed old event does not loosen it.
    expect(clockSkew(skew, [{ time: 1001 }], 996_100)).toBeCloseTo(-4900, 6);
    expect(clockSkew(skew, [{ time: 900 }], 996_100)).toBeCloseTo(-4800, 6);
  });

  it("finds every image and audio file a node made: in lists and dicts, and in streamed frames", () => {
    const file = (id: string, type = "image/png") => ({ $file: id, url: `/api/runs/r/files/${id}/`, content_type: type, bytes: 4 });
    let s = initialRunState(["album", "film"]);
    s = reduceRun(s, {
      type: "node_output", seq: 0, run_id: "r", time: 1, node: "album", port: "out",
      value: { images: [file("a"), file("b")], cover: { front: file("c") }, raw: { bytes: 2 }, caption: "sea" },
    });
    s = reduceRun(s, { type: "node_output", seq: 1, run_id: "r", time: 2, node: "film", port: "out", frame: 0, value: file("d", "audio/wav") });
    s = reduceRun(s, { type: "node_output", seq: 2, run_id: "r", time: 3, node: "film", port: "out", frame: 1, value: { bytes: 9 } });
    s = reduceRun(s, { type: "node_output", seq: 3, run_id: "r", time: 4, node: "film", port: "out", frame: 2, value: file("e") });
    expect(runMedia(s).map(({ name, media }) => `${name}=${media.$file}`)).toEqual([
      "album.out[images][0]=a", "album.out[images][1]=b", "album.out[cover][front]=c", "film.out#0=d", "film.out#2=e",
    ]);
  });

  it("knows a node's image or audio file from other values", () => {
    const image = { $file: "f1", url: "/api/runs/r/files/f1/", content_type: "image/png", bytes: 10 };
    expect(mediaOf(image)).toEqual(image);
    expect(mediaOf({ ...image, content_type: "application/json" })).toBeNull();
    expect(mediaOf({ bytes: 10 })).toBeNull();
    expect(mediaOf("a")).toBeNull();
  });
});

describe("fileIdsIn", () => {
  it("finds the run files named anywhere inside a value, each once, in order", () => {
    const saved = {
      dir: "omniflow-out/r1",
      files: {
        text: { $file: "f-text", url: "/api/runs/r1/files/f-text/", name: "omniflow-out/r1/reply.txt" },
        image: { $file: "f-image", url: "/api/runs/r1/files/f-image/", name: "omniflow-out/r1/image.png" },
      },
    };
    expect(fileIdsIn(saved)).toEqual(["f-text", "f-image"]);
    expect(fileIdsIn([{ $file: "a" }, [{ nested: { $file: "b" } }], { $file: "a" }])).toEqual(["a", "b"]);
  });

  it("names nothing in values without file references", () => {
    expect(fileIdsIn("$file")).toEqual([]);
    expect(fileIdsIn({ $file: 3, other: "x" })).toEqual([]);
    expect(fileIdsIn(null)).toEqual([]);
    expect(fileIdsIn([1, "two", { three: 3 }])).toEqual([]);
  });

  it("takes a file reference as a leaf: what it holds besides its id is not searched", () => {
    expect(fileIdsIn({ $file: "outer", inner: { $file: "ignored" } })).toEqual(["outer"]);
  });
});

describe("plainLeaves", () => {
  it("gives the leaves beside the files, under their keys, as text", () => {
    const saved = {
      dir: "outputs/r1",
      files: { text: { $file: "f-text" }, image: { $file: "f-image" } },
    };
    expect(plainLeaves(saved)).toEqual([{ path: "dir", text: "outputs/r1" }]);
    expect(plainLeaves({ a: [1, { b: null }], c: true })).toEqual([
      { path: "a › 0", text: "1" },
      { path: "a › 1 › b", text: "null" },
      { path: "c", text: "true" },
    ]);
    expect(plainLeaves({ $file: "x" })).toEqual([]);
  });
});
