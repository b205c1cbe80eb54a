// The cluster page's metrics history in a real Chromium, driven by Playwright: the aggregate and
// per-worker charts of a chat deployment's llm worker carry its device, host and disk tiers, the
// memory panel says the cluster is CPU-only and charts process memory, a reload keeps the charts
// (the points from before it come back from the studio's history), and the range picker switches
// to an hour, kept in the URL across a reload; the workers table fits its card at 1024 px (fewer
// columns, the rest in each row) and 1440 px (every column), and scrolls inside it, with a cue, narrower;
// last, on a history of the page's own: a worker whose prompts were all shorter than a KV page says
// so instead of "no lookups yet", and no chart cuts its newest time label at the right edge.
//
//   STUDIO_URL=... STUDIO_USER=... STUDIO_PASSWORD=... LLM_WORKER=<worker id> E2E_ARTIFACTS=... \
//   node e2e/metrics.e2e.mjs
//
// tests/e2e/test_metrics_e2e.py deploys workflows/chat.py, puts it under load and runs this
// script. Every step leaves a screenshot; a failing one FAILED-<step>.png, and exits 1.

import { expect, openBrowser, tid, logIn } from "./harness.mjs";

const BASE = process.env.STUDIO_URL;
const WORKER = process.env.LLM_WORKER;
const WAIT = 30_000;
const TIERS = ["device", "host", "disk"];

const { context, page, shot, step, expectQuietConsole, finish } = await openBrowser(
  "metrics", { viewport: { width: 1500, height: 1400 }, wait: WAIT, fullPage: true });
/** A chart's rows and its first time (`LiveChart`'s data-points, data-first). */
async function chartRows(testId) {
  const el = page.locator(tid(testId));
  return { points: Number(await el.getAttribute("data-points")), first: Number(await el.getAttribute("data-first")) };
}
/** Wait until each tier series of `testId` shows a value (and, with `positive`, one above 0). */
async function tiersShown(testId, positive) {
  await page.waitForFunction(
    ([id, tiers, positive]) => tiers.every((t) => {
      const v = document.querySelector(`[data-testid="${id}-${t}"]`)?.dataset.value;
      return v !== undefined && v !== "" && (!positive || Number(v) > 0);
    }),
    [testId, TIERS, positive],
  );
}
const card = `worker-card-${WORKER}`;

try {
  await step("login", () => logIn(page, BASE, process.env.STUDIO_USER, process.env.STUDIO_PASSWORD));

  let before;
  await step("the cluster page charts the host and disk tiers, overall and per worker", async () => {
    await page.goto(`${BASE}/cluster`);
    await page.waitForSelector(`${tid("cluster-page")}[data-history="loaded"][data-range="5m"]`);
    await page.waitForSelector(`${tid(card)}[data-role="llm"][data-live="true"]`);
    await tiersShown("chart-occupancy", true);
    await tiersShown("chart-hit-rate", false);
    await tiersShown(`${card}-occupancy`, true);
    await tiersShown(`${card}-hit-rate`, false);
    expect(Number(await page.getAttribute(tid(`${card}-hit-rate-device`), "data-value")) > 0,
      "the repeated prompts hit the device tier");
    // a CPU-only cluster: the memory panel says so and charts the processes' RSS
    await page.waitForSelector(tid("chart-process-memory-note"));
    expect(await page.locator(tid("chart-gpu-memory")).count() === 0, "no GPU memory chart on a CPU-only cluster");
    expect(Number(await page.getAttribute(tid("chart-process-memory-rss"), "data-value")) > 0, "RSS is charted");
    expect(Number(await page.getAttribute(tid(`${card}-memory-rss`), "data-value")) > 0, "the worker's RSS");
    await page.waitForFunction((id) => Number(document.querySelector(`[data-testid="${id}"]`)?.dataset.points) >= 8,
      "chart-occupancy");
    // The y axes label their ticks distinctly (with 0.5% steps, occupancy read "0%, 1%, 1%, 2%, 2%").
    for (const chart of ["chart-occupancy", "chart-hit-rate", "chart-process-memory", `${card}-occupancy`]) {
      const labels = (await page.getAttribute(`${tid(chart)} .chart-box`, "data-y-ticks")).split("|");
      expect(labels.length >= 2 && new Set(labels).size === labels.length, `${chart}'s y axis reads ${labels.join(", ")}`);
    }
    await page.locator(tid("worker-charts")).scrollIntoViewIfNeeded();
    await shot("cluster-tiers");
    before = await chartRows("chart-occupancy");
  });

  await step("a reload keeps the charts: the history comes back from the studio", async () => {
    const reloadedAt = Date.now() / 1000;
    await page.reload();
    await page.waitForSelector(`${tid("cluster-page")}[data-history="loaded"]`);
    await tiersShown(`${card}-occupancy`, true);
    // The newest point the page had live may not be in the studio's history yet (the sampler and the
    // live stream tick apart): wait for the rows to catch up, and fail if they never do.
    await page.waitForFunction(([id, rows]) => Number(document.querySelector(`[data-testid="${id}"]`)?.dataset.points) >= rows,
      ["chart-occupancy", before.points], { timeout: 10_000 }).catch(() => undefined);
    const after = await chartRows("chart-occupancy");
    expect(after.first <= before.first && after.first < reloadedAt - 2,
      `the charts start at ${after.first}, before the reload at ${reloadedAt} (first point before: ${before.first})`);
    expect(after.points >= before.points, `${after.points} rows after the reload, ${before.points} before`);
    await tiersShown("chart-occupancy", true);
    await shot("cluster-after-reload");
  });

  await step("the range picker switches to the last hour, kept across a reload", async () => {
    await page.click(tid("range-1h"));
    await page.waitForURL(/range=1h/);
    await page.waitForSelector(`${tid("cluster-page")}[data-history="loaded"][data-range="1h"]`);
    expect(await page.getAttribute(tid("range-1h"), "aria-pressed") === "true", "1 h is the pressed range");
    expect(await page.getAttribute(tid("range-5m"), "aria-pressed") === "false", "5 min is not");
    await tiersShown(`${card}-occupancy`, true);
    const hour = await chartRows("chart-occupancy");
    // an hour is thinned to the last point of every 5 s: it starts within 5 s of the first point
    expect(hour.points > 0 && hour.first <= before.first + 5, `the hour's chart starts at ${hour.first}, not with ${before.first}`);
    await page.reload();
    await page.waitForSelector(`${tid("cluster-page")}[data-history="loaded"][data-range="1h"]`);
    await tiersShown("chart-occupancy", true);
    await shot("cluster-range-1h");
    await page.click(tid("range-5m"));
    await page.waitForSelector(`${tid("cluster-page")}[data-history="loaded"][data-range="5m"]`);
  });

  await step("the workers table fits its card at 1024 px and shows every column at 1440", async () => {
    /** The table's frame (ScrollTable), how its columns sit in it, and the labels of the columns shown. */
    const layout = () =>
      page.evaluate(() => {
        const frame = document.querySelector('[data-testid="workers-card"]');
        const scroller = frame.querySelector(".scroll-table-body");
        const right = frame.getBoundingClientRect().right;
        const shown = [...frame.querySelectorAll("thead th")].filter((th) => th.offsetParent !== null);
        return {
          overflow: scroller.scrollWidth - scroller.clientWidth,
          cue: frame.dataset.hiddenRight,
          headers: shown.map((th) => th.textContent.trim()),
          cut: shown.filter((th) => th.getBoundingClientRect().right > right + 0.5).map((th) => th.textContent.trim()),
          narrowShown: [...frame.querySelectorAll("tbody .narrow-only")].filter((el) => el.offsetParent !== null).length,
        };
      });
    for (const [width, height] of [[1024, 768], [1440, 900]]) {
      await page.setViewportSize({ width, height });
      // once resized: the cue agrees with the table's overflow (ScrollTable measured the new width)
      await page.waitForFunction(() => {
        const frame = document.querySelector('[data-testid="workers-card"]');
        const scroller = frame?.querySelector(".scroll-table-body");
        return scroller && frame.dataset.hiddenRight === String(scroller.scrollWidth - scroller.clientWidth > 1);
      });
      const rows = await page.locator(tid("worker-row")).count();
      expect(rows >= 2, `the chat deployment's workers are listed: ${rows} rows`);
      const l = await layout();
      expect(l.overflow <= 1 && l.cue === "false", `at ${width} px the table fits its card: ${JSON.stringify(l)}`);
      expect(l.cut.length === 0, `at ${width} px no column runs past the card: ${l.cut.join(", ")}`);
      if (width === 1024) {
        expect(!l.headers.includes("Heartbeat") && !l.headers.includes("Device"), `at 1024 px: ${l.headers.join(", ")}`);
        // what the two columns said is still in each row: the device under the role, the heartbeat under the state
        expect(l.narrowShown === 2 * rows, `the device and heartbeat of each of ${rows} rows: ${l.narrowShown} shown`);
        await page.waitForSelector(`${tid("worker-row")} >> text=/seen \\d+ s ago/`);
      } else {
        expect(l.headers.length === 8 && l.headers.at(-1) === "Heartbeat", `at 1440 px every column: ${l.headers.join(", ")}`);
        expect(l.narrowShown === 0, "no repeated device or heartbeat lines when the columns are there");
      }
      await page.locator(tid("workers-table")).scrollIntoViewIfNeeded();
      await shot(`cluster-workers-${width}`);
    }
    // A window narrower still: the table scrolls inside its card, its right side fading (the cue).
    await page.setViewportSize({ width: 800, height: 700 });
    await page.waitForSelector(`${tid("workers-card")}[data-hidden-right="true"]`);
    await page.locator(`${tid("workers-card")} .scroll-table-body`).evaluate((el) => { el.scrollLeft = el.scrollWidth; });
    await page.waitForSelector(`${tid("workers-card")}[data-hidden-right="false"][data-hidden-left="true"]`);
    await page.setViewportSize({ width: 1500, height: 1400 });
  });

  await step("a worker whose prompts were too short to look a page up says so; the newest time label is whole", async () => {
    // The history is the page's own (the metrics socket answered here): one llm worker that took in
    // 23 prompt tokens and looked no page up, its points ending on a whole hour, where a tick of any
    // step lands, its label centred on the plot's right end.
    const mocked = await context.newPage();
    const end = Math.floor(Date.now() / 3_600_000) * 3600;
    const points = Array.from({ length: 61 }, (_, i) => ({
      t: end - 300 + 5 * i, rss_bytes: 5e8, prompt_tokens: 23,
      tiers: { device: { lookups: 0, hits: 0, pages_used: 2, capacity_pages: 64 } },
    }));
    await mocked.routeWebSocket(/\/ws\/metrics\//, (ws) => {
      ws.send(JSON.stringify({ type: "history", range: "1h", range_s: 3600, step_s: 5, workers: [
        { worker_id: "short-prompts", deployment: "d", role: "llm", device: "cpu", host: "h", model: "smollm2-135m", points },
      ] }));
    });
    await mocked.goto(`${BASE}/cluster?range=1h`);
    await mocked.waitForSelector(`${tid("cluster-page")}[data-history="loaded"][data-range="1h"]`);
    const note = await mocked.textContent(tid("worker-card-short-prompts-hit-rate-empty"));
    expect(note.includes("prompts came in (23 tokens in all)") && note.includes("too short to fill a KV page"),
      `the worker's hit rate says why it has none: ${note}`);
    await mocked.waitForFunction(() => [...document.querySelectorAll(".chart")].every((c) => Number(c.dataset.points) === 61));
    await mocked.evaluate(() => new Promise((resolve) => requestAnimationFrame(() => requestAnimationFrame(resolve))));
    // Each chart's canvas: the band of its time labels holds the newest label near its right end, and
    // no label reaches either edge (one cut there reads "12:00:00 A", or ":55:00 PM").
    const labels = await mocked.$$eval(".chart-box canvas", (canvases) => canvases.map((c) => {
      const ratio = c.width / c.getBoundingClientRect().width;
      const band = Math.round(38 * ratio); // the 50 px axis under the plot, less its tick marks
      const ink = c.getContext("2d").getImageData(0, c.height - band, c.width, band).data;
      const inked = (x) => {
        for (let y = 0; y < band; y++) if (ink[(y * c.width + x) * 4 + 3] > 0) return true;
        return false;
      };
      const near = Array.from({ length: Math.round(90 * ratio) }, (_, i) => c.width - 1 - i).some(inked);
      return { chart: c.closest(".chart").dataset.testid, near, edge: [0, 1, c.width - 2, c.width - 1].some(inked) };
    }));
    expect(labels.length >= 5 && labels.every((l) => l.near), `a time label at each chart's right end: ${JSON.stringify(labels)}`);
    const cut = labels.filter((l) => l.edge).map((l) => l.chart);
    expect(cut.length === 0, `a time label is cut at an edge of ${cut.join(", ")}`);
    await mocked.locator(tid("worker-charts")).scrollIntoViewIfNeeded();
    await shot("cluster-short-prompts-1h", mocked);
    await mocked.close();
  });

  expectQuietConsole();
} finally {
  await finish();
}
