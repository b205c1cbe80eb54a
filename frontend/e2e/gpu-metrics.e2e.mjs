// GPU memory on the cluster page in a real Chromium, driven by Playwright, fed by the heartbeats of
// workers that report a CUDA device (tests/e2e/test_gpu_metrics_e2e.py joins them to a deployment
// through the studio's Redis registry). Two phases, one run each:
//
//   PHASE=cpu  only the deployment's CPU python worker (PY_WORKER): the memory panel says the cluster
//              is CPU-only and charts process memory (RSS); no GPU memory chart.
//   PHASE=gpu  GPU_WORKERS (JSON: [{worker, label, allocated}]) heartbeat too: "GPU memory by device"
//              draws one series per device, labelled "<host> <device>", whose latest value is the
//              allocated bytes the device's worker reported, with byte-labelled y ticks; each GPU
//              worker's card charts its own device, the python worker's card still its RSS; after a
//              reload the GPU chart comes back with its points from the studio's history.
//
//   STUDIO_URL=... STUDIO_USER=... STUDIO_PASSWORD=... PHASE=... PY_WORKER=... GPU_WORKERS=... \
//   E2E_ARTIFACTS=... node e2e/gpu-metrics.e2e.mjs

import { expect, openBrowser, tid, logIn } from "./harness.mjs";

const BASE = process.env.STUDIO_URL;
const PHASE = process.env.PHASE;
const PY = process.env.PY_WORKER;
const GPUS = JSON.parse(process.env.GPU_WORKERS ?? "[]");
const WAIT = 30_000;
expect(PHASE === "cpu" || (PHASE === "gpu" && GPUS.length > 0), `PHASE=cpu, or PHASE=gpu with GPU_WORKERS; got ${PHASE}`);

const { page, shot, step, expectQuietConsole, finish } = await openBrowser(
  `gpu-metrics-${PHASE}`, { viewport: { width: 1500, height: 1400 }, wait: WAIT, fullPage: true });

/** The latest value a chart's series shows (`LiveChart`'s data-value on `<testId>-<label>`), once it has one. */
async function seriesValue(testId, label) {
  const selector = `[data-testid="${testId}-${label}"]`;
  await page.waitForFunction((s) => (document.querySelector(s)?.dataset.value ?? "") !== "", selector);
  return Number(await page.getAttribute(selector, "data-value"));
}
/** The series labels a chart's legend lists. */
const legend = (testId) =>
  page.$$eval(`[data-testid="${testId}"] [data-testid^="${testId}-"][data-value]`,
    (els, id) => els.map((el) => el.dataset.testid.slice(id.length + 1)), testId);
/** A y tick's label ("0 B", "5 GiB") in bytes; NaN for anything else. */
function tickBytes(label) {
  const m = /^(\d+(?:\.\d+)?) (B|KiB|MiB|GiB|TiB)$/.exec(label);
  return m ? Number(m[1]) * 1024 ** ["B", "KiB", "MiB", "GiB", "TiB"].indexOf(m[2]) : NaN;
}
/** The colour of a series' legend dot. */
const dotColor = (testId, label) =>
  page.$eval(`[data-testid="${testId}-${label}"] .legend-dot`, (el) => getComputedStyle(el).backgroundColor);
const yTicks = async (testId) => (await page.getAttribute(`${tid(testId)} .chart-box`, "data-y-ticks")).split("|");

try {
  await step("login", () => logIn(page, BASE, process.env.STUDIO_USER, process.env.STUDIO_PASSWORD));

  if (PHASE === "cpu") {
    await step("a CPU-only cluster: the memory panel says so and charts RSS", async () => {
      await page.goto(`${BASE}/cluster`);
      await page.waitForSelector(`${tid("cluster-page")}[data-history="loaded"]`);
      await page.waitForSelector(`${tid(`worker-card-${PY}`)}[data-live="true"]`);
      const note = await page.textContent(tid("chart-process-memory-note"));
      expect(note.includes("CPU-only cluster") && note.includes("RSS"), `the note: ${note}`);
      expect(await page.locator(tid("chart-gpu-memory")).count() === 0, "no GPU memory chart on a CPU-only cluster");
      expect(await seriesValue("chart-process-memory", "rss") > 0, "the cluster's RSS is charted");
      expect(await seriesValue(`worker-card-${PY}-memory`, "rss") > 0, "the python worker's RSS is charted");
      await page.locator(tid("chart-process-memory")).scrollIntoViewIfNeeded();
      await shot("cpu-only");
    });
  } else {
    const labels = GPUS.map((g) => g.label).sort();
    /** Every GPU series of the overall chart shows its worker's allocated bytes. */
    async function gpuChartShown() {
      await page.waitForSelector(tid("chart-gpu-memory"));
      for (const g of GPUS) {
        await page.waitForFunction(([s, v]) => Number(document.querySelector(s)?.dataset.value) === v,
          [`[data-testid="chart-gpu-memory-${g.label}"]`, g.allocated]);
      }
      const shown = (await legend("chart-gpu-memory")).sort();
      expect(JSON.stringify(shown) === JSON.stringify(labels), `the GPU chart's series: ${shown.join(", ")}; expected ${labels.join(", ")}`);
    }

    let before;
    await step("GPU memory by device: one series per device, its allocated bytes", async () => {
      await page.goto(`${BASE}/cluster`);
      await page.waitForSelector(`${tid("cluster-page")}[data-history="loaded"]`);
      await gpuChartShown();
      expect(await page.locator(tid("chart-process-memory")).count() === 0, "no RSS chart beside the GPU one");
      expect(await page.locator(tid("chart-process-memory-note")).count() === 0, "no CPU-only note");
      const title = await page.textContent(`${tid("chart-gpu-memory")} .chart-title, ${tid("chart-gpu-memory")} h3`);
      expect(title.includes("GPU memory"), `the chart's title: ${title}`);
      // the legend reads each device's allocation in bytes' units (formatBytes: 3.25 GiB -> "3.3 GiB")
      for (const g of GPUS) {
        const text = await page.textContent(tid(`chart-gpu-memory-${g.label}`));
        expect(text.includes(g.label) && /\d(\.\d)? GiB/.test(text), `the legend of ${g.label}: ${text}`);
      }
      // the y axis counts bytes from 0 B in even steps of a byte unit, up past the largest allocation
      const ticks = await yTicks("chart-gpu-memory");
      const bytes = ticks.map(tickBytes);
      const steps = bytes.slice(1).map((b, i) => b - bytes[i]);
      expect(ticks[0] === "0 B" && bytes.every((b) => !Number.isNaN(b)) && steps.every((d) => d > 0 && d === steps[0])
        && bytes.at(-1) >= Math.max(...GPUS.map((g) => g.allocated)), `the GPU chart's y axis reads ${ticks.join(", ")}`);
      await page.locator(tid("chart-gpu-memory")).scrollIntoViewIfNeeded();
      await shot("gpu-memory");
      before = Number(await page.getAttribute(tid("chart-gpu-memory"), "data-first"));
    });

    await step("each GPU worker's card charts its device; the python worker's its RSS", async () => {
      for (const g of GPUS) {
        const card = `worker-card-${g.worker}`;
        await page.waitForSelector(`${tid(card)}[data-live="true"]`);
        expect((await page.textContent(tid(`${card}-memory`))).includes("GPU memory"), `${g.worker}'s chart is titled GPU memory`);
        expect(JSON.stringify(await legend(`${card}-memory`)) === JSON.stringify([g.label]), `${g.worker}'s card charts ${g.label} alone`);
        expect(await seriesValue(`${card}-memory`, g.label) === g.allocated, `${g.worker}'s card shows ${g.allocated} bytes`);
        const [own, overall] = [await dotColor(`${card}-memory`, g.label), await dotColor("chart-gpu-memory", g.label)];
        expect(own === overall, `${g.label} is drawn in ${own} on its worker's card, ${overall} on the cluster's chart`);
      }
      const colors = await Promise.all(GPUS.map((g) => dotColor("chart-gpu-memory", g.label)));
      expect(new Set(colors).size === GPUS.length, `each device its own colour: ${colors.join(", ")}`);
      const py = `worker-card-${PY}`;
      expect((await page.textContent(tid(`${py}-memory`))).includes("Process memory (RSS)"), "the python worker's card charts RSS");
      expect(await seriesValue(`${py}-memory`, "rss") > 0, "the python worker's RSS");
      await page.locator(tid(py)).scrollIntoViewIfNeeded();
      await shot("gpu-worker-cards");
    });

    await step("a reload keeps the GPU chart: its points come back from the studio's history", async () => {
      const reloadedAt = Date.now() / 1000;
      await page.reload();
      await page.waitForSelector(`${tid("cluster-page")}[data-history="loaded"]`);
      await gpuChartShown();
      const first = Number(await page.getAttribute(tid("chart-gpu-memory"), "data-first"));
      expect(first <= before && first < reloadedAt - 1, `the GPU chart starts at ${first}, before the reload at ${reloadedAt}`);
      await page.locator(tid("chart-gpu-memory")).scrollIntoViewIfNeeded();
      await shot("gpu-after-reload");
    });
  }

  expectQuietConsole();
} finally {
  await finish();
}
