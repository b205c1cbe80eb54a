import { describe, expect, it } from "vitest";
import type { WorkerSnapshot } from "./cluster";
import { appendLive, column, fromHistory, hasGpu, type HistoryBody, mean, promptTokensOf, rangeOf, sampleOfPoint, tiersOf } from "./metrics";

const tiers = { device: { lookups: 10, hits: 5, pages_used: 8, capacity_pages: 32 }, host: { lookups: 5, hits: 1, pages_used: 4, capacity_pages: 64 } };

function history(): HistoryBody {
  return {
    range: "5m",
    range_s: 300,
    workers: [
      {
        worker_id: "llm-0",
        deployment: "d",
        role: "llm",
        device: "cpu",
        host: "h",
        model: "tiny-llama",
        points: [
          { t: 100, rss_bytes: 1000, tiers, generated_tokens: 10 },
          { t: 101, rss_bytes: 1100, tiers, generated_tokens: 30 },
        ],
      },
      { worker_id: "py-0", deployment: "d", role: "py", device: "cpu", host: "h", model: null, points: [{ t: 101, rss_bytes: 500 }] },
    ],
  };
}

function live(metrics: Record<string, number>, id = "llm-0"): WorkerSnapshot {
  return {
    info: { worker_id: id, role: "llm", address: "tcp://h:1", capacity: 8, model: "tiny-llama", device: "cpu", host: "h", pid: 1, meta: {} },
    load: { outstanding: 0, queue_depth: 0, busy: false, metrics },
    last_heartbeat: 0,
    deployment: "d",
  };
}

describe("history points read as chart samples", () => {
  it("hit rate and occupancy of the tiers a worker has, RSS, tokens/s between points", () => {
    const first = sampleOfPoint({ t: 1, tiers, rss_bytes: 7, generated_tokens: 4 }, "cpu");
    expect(first.hitRate).toEqual({ device: 0.5, host: 0.2 });
    expect(first.occupancy).toEqual({ device: 0.25, host: 0.0625 });
    expect(first.tiers).toEqual(["device", "host"]);
    expect([first.rssBytes, first.gpuMemoryBytes, first.tokensPerS]).toEqual([7, null, null]);
    expect(sampleOfPoint({ t: 3, generated_tokens: 10 }, "cpu", first).tokensPerS).toBe(3);
    const unused = sampleOfPoint({ t: 1, tiers: { disk: { lookups: 0, capacity_pages: 4 } } }, "cpu");
    expect([unused.tiers, unused.hitRate]).toEqual([["disk"], {}]); // configured, nothing looked up yet
    expect(sampleOfPoint({ t: 1, gpu: { device: "cuda:0", allocated_bytes: 9 } }, "cuda:0").gpuMemoryBytes).toBe(9);
  });
});

describe("a timeline from the history, followed live", () => {
  it("aligns the workers' points by time", () => {
    const timeline = fromHistory(history());
    expect(timeline.times).toEqual([100, 101]);
    expect(timeline.tracks.get("d/py-0")!.samples.map((s) => s?.rssBytes ?? null)).toEqual([null, 500]);
    expect(timeline.tracks.get("d/llm-0")!.samples[1]!.tokensPerS).toBe(20);
    expect(tiersOf(timeline)).toEqual(["device", "host"]);
    expect(hasGpu(timeline)).toBe(false);
    expect(column(timeline, (s) => s.rssBytes, mean)).toEqual([1000, 800]);
  });

  it("puts a gap row where no worker was sampled for a while", () => {
    const body: HistoryBody = {
      range: "5m",
      range_s: 300,
      step_s: 1,
      workers: [{ ...history().workers[1], points: [{ t: 100, rss_bytes: 1 }, { t: 101, rss_bytes: 2 }, { t: 160, rss_bytes: 3 }] }],
    };
    const timeline = fromHistory(body);
    expect(timeline.times).toEqual([100, 101, 102, 160]);
    expect(column(timeline, (s) => s.rssBytes, mean)).toEqual([1, 2, null, 3]);
  });

  it("appends live rows after the history, keeps gone workers while in range, drops rows past it", () => {
    let timeline = fromHistory(history());
    timeline = appendLive(timeline, 102, [live({ rss_bytes: 1200, "llm.generated_tokens": 50 })], 300);
    expect(timeline.times).toEqual([100, 101, 102]);
    const llm = timeline.tracks.get("d/llm-0")!;
    expect(llm.samples.map((s) => s?.rssBytes)).toEqual([1000, 1100, 1200]);
    expect(llm.samples[2]!.tokensPerS).toBe(20); // from the history's last point
    expect(timeline.tracks.get("d/py-0")!.samples).toHaveLength(3); // gone, still in range
    expect(appendLive(timeline, 101.5, [], 300)).toBe(timeline); // not newer than the last row
    timeline = appendLive(timeline, 402, [live({ rss_bytes: 1300 })], 300);
    expect(timeline.times).toEqual([102, 402]);
    expect([...timeline.tracks.keys()]).toEqual(["d/llm-0"]); // py-0 had no point left in range
  });

  it("sums the prompt tokens the workers took in, by each one's latest sample (null: no LLM)", () => {
    const body = history();
    body.workers[0].points = [{ t: 100, tiers, prompt_tokens: 14 }, { t: 101, tiers, prompt_tokens: 30 }];
    let timeline = fromHistory(body);
    expect(timeline.tracks.get("d/llm-0")!.samples.map((s) => s?.promptTokens)).toEqual([14, 30]);
    expect(promptTokensOf(timeline)).toBe(30);
    expect(promptTokensOf(timeline, (t) => t.role === "py")).toBeNull();
    timeline = appendLive(timeline, 102, [live({ "llm.prompt_tokens": 45 }), live({ "llm.prompt_tokens": 7 }, "llm-1")], 300);
    expect(promptTokensOf(timeline)).toBe(52);
    expect(promptTokensOf(fromHistory(history()))).toBeNull(); // points without the counter
  });

  it("knows the two ranges and falls back to 5 minutes", () => {
    expect(rangeOf("1h").seconds).toBe(3600);
    expect(rangeOf(null).id).toBe("5m");
    expect(rangeOf("7d").id).toBe("5m");
  });
});
