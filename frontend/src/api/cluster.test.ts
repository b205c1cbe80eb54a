import { describe, expect, it } from "vitest";
import { cacheScopeLabel, noLookupsNote, numberTick, percent, percentTick, sampleOf, stepDecimals, type WorkerSnapshot } from "./cluster";

function worker(metrics: Record<string, number>): WorkerSnapshot {
  return {
    info: { worker_id: "w1", role: "lm", address: "tcp://h:1", capacity: 8, model: "tiny", device: "cuda:0", host: "h", pid: 1, meta: {} },
    load: { outstanding: 0, queue_depth: 0, busy: false, metrics },
    last_heartbeat: 100,
  };
}

describe("sampleOf reads the documented gauges", () => {
  it("hit rate and occupancy per tier, GPU memory", () => {
    const s = sampleOf(
      worker({
        "device.hit_rate": 0.5,
        "host.hit_rate": 0.25,
        "device.pages_used": 30,
        "device.capacity_pages": 120,
        "disk.pages_used": 5,
        "disk.capacity_pages": 0,
        "gpu.memory_used_bytes": 2048,
      }),
      10,
    );
    expect(s.hitRate).toEqual({ device: 0.5, host: 0.25 });
    expect(s.occupancy).toEqual({ device: 0.25 }); // a tier without capacity has no occupancy
    expect(s.gpuMemoryBytes).toBe(2048);
    expect(s.tokensPerS).toBeNull();
  });

  it("a tier nothing was looked up in yet has no hit rate", () => {
    const s = sampleOf(worker({ "device.hit_rate": 0, "device.lookups": 0, "host.hit_rate": 0, "host.lookups": 3 }), 1);
    expect(s.hitRate).toEqual({ host: 0 });
  });

  it("the prompt tokens its LLM took in (null without one)", () => {
    expect(sampleOf(worker({ "llm.prompt_tokens": 30 }), 1).promptTokens).toBe(30);
    expect(sampleOf(worker({ "device.lookups": 0 }), 1).promptTokens).toBeNull();
  });

  it("tokens/s from the gauge, else from the generated-tokens counter between samples", () => {
    expect(sampleOf(worker({ "llm.tokens_per_s": 42 }), 1).tokensPerS).toBe(42);
    const first = sampleOf(worker({ "llm.generated_tokens": 100 }), 10);
    expect(first.tokensPerS).toBeNull();
    const second = sampleOf(worker({ "llm.generated_tokens": 400 }), 12, first);
    expect(second.tokensPerS).toBe(150);
    const restarted = sampleOf(worker({ "llm.generated_tokens": 50 }), 14, second);
    expect(restarted.tokensPerS).toBe(0);
  });
});

describe("cacheScopeLabel", () => {
  it("says so when a deployment's users share its cache, and nothing otherwise", () => {
    expect(cacheScopeLabel({ cache_scope: "shared" })).toBe("cache: shared across users");
    expect(cacheScopeLabel({ cache_scope: "user" })).toBeNull();
    expect(cacheScopeLabel({})).toBeNull(); // a studio that does not report it: each user's own
  });
});

describe("axis ticks stay distinct", () => {
  it("stepDecimals: the decimals multiples of the step need", () => {
    expect([1, 5, 20, 0.5, 0.25, 0.2, 0.05, 0.005, 0.0001].map(stepDecimals)).toEqual([0, 0, 0, 1, 2, 1, 2, 3, 3]);
  });

  it("percent ticks of a range under a few percent read 0.5%, 1.0% (not 0%, 1%, 1%)", () => {
    const ticks = [0, 0.005, 0.01, 0.015].map((v) => percentTick(v, 0.005));
    expect(ticks).toEqual(["0.0%", "0.5%", "1.0%", "1.5%"]);
    expect([0, 0.5, 1].map((v) => percentTick(v, 0.5))).toEqual(["0%", "50%", "100%"]);
  });

  it("number ticks under 1 keep their decimals", () => {
    expect([0, 0.5, 1, 1.5].map((v) => numberTick(v, 0.5))).toEqual(["0.0", "0.5", "1.0", "1.5"]);
    expect([0, 2, 4].map((v) => numberTick(v, 2))).toEqual(["0", "2", "4"]);
  });

  it("a latest value under 10% keeps one decimal", () => {
    expect([0, 0.004, 0.012, 0.5, 1].map(percent)).toEqual(["0%", "0.4%", "1.2%", "50%", "100%"]);
  });
});

describe("noLookupsNote", () => {
  it("waits for the first prompt while none came", () => {
    expect(noLookupsNote(null)).toBe("No KV lookups yet: the hit rate starts with the first prompt.");
    expect(noLookupsNote(0)).toBe("No KV lookups yet: the hit rate starts with the first prompt.");
  });

  it("says prompts did come, too short to look a page up", () => {
    // the walk's chat worker: two prompts of 7 and 16 tokens, neither longer than a 16-token page
    const note = noLookupsNote(23);
    expect(note).toContain("prompts came in (23 tokens in all)");
    expect(note).toContain("too short to fill a KV page");
    expect(note).not.toContain("starts with the first prompt");
  });
});
