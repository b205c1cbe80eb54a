// Runs people can watch, in a real Chromium driven by Playwright, against a live studio.
//
//   STUDIO_URL=... STUDIO_USER=... STUDIO_PASSWORD=... E2E_ARTIFACTS=... E2E_FIXTURES=<tests/e2e/workflows>
//   E2E_DATA_DIR=<the studio's data folder> node e2e/runs.e2e.mjs
//
// tests/e2e/test_runs_e2e.py runs it against the studio of tests/e2e/conftest.py:
//  - e2e-watch (watch.json) run from the form: its graph drawn, every node pending, while its event
//    socket is held back (before the first event); then, while its llm role's unit loads the model,
//    the run and the node's row say so; its llm node (the real smollm2-135m, 120 tokens) draws
//    a progress bar that moves, "n/120 tokens" beside it; live times never negative, and the reply's last
//    live time agrees with its final one;
//  - the image its `paint` node makes (no workflow output) previewed as a thumbnail that opens full size
//    (enlarged to 512 px, pixelated; Escape or a click closes it), served as the run's file, and the tone
//    of its `voice` node in a player; no server path on the page;
//  - the streamed reply reads as text; each node says where it ran;
//  - "Run again" starts from the previous run's inputs;
//  - the runs list, open in another tab, shows the new run without a reload, and cancels it.
// Every step leaves a screenshot in E2E_ARTIFACTS; a failing one FAILED-<step>.png, and exits 1.

import { readFileSync } from "node:fs";
import { join, resolve } from "node:path";

import { expect, logIn, openBrowser, tid } from "./harness.mjs";

const BASE = process.env.STUDIO_URL ?? "http://127.0.0.1:8000";
const USER = process.env.STUDIO_USER ?? "demo";
const PASSWORD = process.env.STUDIO_PASSWORD ?? "demo";
const FIXTURES = resolve(process.env.E2E_FIXTURES ?? "../tests/e2e/workflows");
const DATA_DIR = process.env.E2E_DATA_DIR ?? "";
const WAIT = 30_000;
const CAPTION = "a lighthouse at dusk";

const { context, page, shot, step, waitText, expectQuietConsole, finish } = await openBrowser(
  "runs", { wait: WAIT });
const runIdOf = (url) => url.split("/runs/")[1].replace(/[/?#].*$/, "");
async function runDetail(id) {
  return page.evaluate(async (runId) => (await fetch(`/api/runs/${runId}/`)).json(), id);
}
/** A time as `formatMs` writes it ("850 ms", "5.12 s", "1 min 3 s"), in ms; null when blank. */
function parseTime(text) {
  const t = text.trim();
  if (!t) return null;
  const min = /^(\d+) min (\d+) s$/.exec(t);
  if (min) return Number(min[1]) * 60_000 + Number(min[2]) * 1000;
  const one = /^([\d.]+) (ms|s)$/.exec(t);
  expect(one, `a time reads "${t}"`);
  return Number(one[1]) * (one[2] === "s" ? 1000 : 1);
}

/** No live time on the page reads negative (node table, node cards, the run's own). */
async function noNegativeTimes() {
  const times = await page.$$eval(
    `${tid("node-table")} td.right, .spec-node-run .timing, ${tid("run-duration")}`,
    (els) => els.map((e) => e.textContent ?? ""),
  );
  expect(times.every((t) => !t.includes("-")), `a negative time is shown: ${JSON.stringify(times)}`);
}

let firstRun = "";
try {
  await step("login", () => logIn(page, BASE, USER, PASSWORD));

  await step("run e2e-watch and see the llm node's progress bar move", async () => {
    await page.click(tid("import-workflow"));
    await page.fill('textarea[aria-label="GraphSpec JSON or Python DSL source"]', readFileSync(join(FIXTURES, "watch.json"), "utf8"));
    await page.click(tid("import-submit"));
    await page.waitForSelector(tid("editor"));
    await page.click(tid("run"));
    await page.waitForSelector(tid("run-form"));
    await page.fill(`${tid("input-caption")} textarea`, CAPTION);
    // The run's event socket is held back (the server's messages kept here) until the graph is seen:
    // it is drawn from the run's own detail, before any event arrives, not built up from the events.
    let release = null;
    let opened;
    const socketOpened = new Promise((resolve) => {
      opened = resolve;
    });
    await page.routeWebSocket(/\/ws\/runs\//, (ws) => {
      const server = ws.connectToServer();
      if (release !== null) return; // later sockets (a reconnect, the next run) pass straight through
      opened();
      const held = [];
      let holding = true;
      let until = null; // while set: messages pass until one it matches has, then they are held again
      const pass = (message) => {
        ws.send(message);
        if (until?.(JSON.parse(message))) {
          until = null;
          holding = true;
        }
      };
      server.onMessage((message) => (holding ? held.push(message) : pass(message)));
      release = (match = null) => {
        until = match;
        holding = false;
        while (held.length && !holding) pass(held.shift());
      };
    });
    await page.click(tid("submit-run"));
    await page.waitForSelector(tid("run-page"));
    firstRun = runIdOf(page.url());
    const specNodes = JSON.parse(readFileSync(join(FIXTURES, "watch.json"), "utf8")).nodes.map((n) => n.id);
    await page.waitForFunction((ids) => ids.every((id) => document.querySelector(`[data-testid="node-${id}"]`)), specNodes);
    await socketOpened;
    const drawn = await page.$$eval(".react-flow__node [data-state]", (els) => els.map((e) => e.dataset.state));
    const logged = (await page.textContent(`${tid("event-log")} summary`)).trim();
    expect(logged === "Events (0)", `no event has reached the page yet: ${logged}`);
    expect(drawn.length === specNodes.length && drawn.every((st) => st === "pending"),
      `every node drawn, pending, before the first event: ${JSON.stringify(drawn)}`);
    await shot("run-graph-before-events");
    // The studio's first run of this llm role builds its unit, loading smollm2-135m (its own engine, in
    // process): the events pass up to the reply's report of that, while it is queued; the page says
    // what the run waits for, on the run and on the node's row.
    release((event) => event.type === "node_progress" && event.node === "reply");
    await waitText(tid("run-waiting"), "reply: loading smollm2-135m (role llm)");
    await waitText(tid("node-waiting-reply"), "loading smollm2-135m (role llm)");
    expect(await page.getAttribute(tid("node-row-reply"), "data-state") === "queued", "the reply is queued meanwhile");
    await shot("run-loading-model");
    release();
    await page.waitForSelector(tid("run-waiting"), { state: "detached" }); // it runs: nothing waits any more
    // The reply's time as the node table shows it, sampled in the page until the reply ends: its
    // last live reading is compared with its final time below.
    await page.evaluate(() => {
      window.__replyTimes = [];
      const sample = () => {
        const row = document.querySelector('[data-testid="node-row-reply"]');
        if (row) window.__replyTimes.push({ state: row.dataset.state, text: row.querySelector('[data-testid="node-time-reply"]').textContent });
        if (!["done", "failed", "cancelled"].includes(row?.dataset.state)) window.setTimeout(sample, 20);
      };
      sample();
    });
    const bar = `${tid("node-reply")} ${tid("node-progress")}`;
    await page.waitForSelector(bar, { timeout: 60_000 }); // the first run loads the model
    const first = Number(await page.getAttribute(bar, "aria-valuenow"));
    await page.waitForFunction(
      ([s, v]) => Number(document.querySelector(s)?.getAttribute("aria-valuenow")) > v, [bar, first], { timeout: WAIT });
    // A quarter of the way, so the screenshot shows the bar as a user sees it mid-reply.
    await page.waitForFunction((s) => Number(document.querySelector(s)?.getAttribute("aria-valuenow")) >= 25, bar,
                               { timeout: 2 * WAIT }); // 30 of 120 tokens: the real model, at the machine's pace
    const later = Number(await page.getAttribute(bar, "aria-valuenow"));
    const label = await page.textContent(`${tid("node-reply")} ${tid("node-progress-text")}`);
    expect(/^\d+\/120 tokens$/.test(label.trim()), `the progress reads "${label}"`);
    expect((await page.locator(tid("table-progress-reply")).count()) === 1, "the node table draws the bar too");
    await noNegativeTimes();
    console.log(`     progress moved ${first}% -> ${later}% (${label})`);
    await shot("run-progress-moving");
  });

  await step("the intermediate image: a thumbnail that opens full size; a node's audio: a player", async () => {
    const thumb = tid("media-thumb-paint.picture");
    await page.waitForSelector(thumb);
    await page.waitForFunction((s) => document.querySelector(s)?.naturalWidth === 256, thumb);
    const src = await page.getAttribute(thumb, "src");
    expect(/^\/api\/runs\/[0-9a-f-]+\/files\/[0-9a-f-]+\/$/.test(src), `the thumbnail is a run file: ${src}`);
    await page.click(thumb);
    await page.waitForSelector(tid("lightbox-image"));
    await page.waitForFunction((s) => document.querySelector(s)?.naturalWidth === 256, tid("lightbox-image"));
    // 256x128, smaller than the lightbox's least side (512 px): enlarged by a whole factor, crisp.
    await page.waitForSelector(`${tid("lightbox-image")}[data-zoom="2"]`);
    const shown = await page.$eval(tid("lightbox-image"), (img) => {
      const box = img.getBoundingClientRect();
      return { width: box.width, height: box.height, rendering: getComputedStyle(img).imageRendering };
    });
    expect(shown.width === 512 && shown.height === 256 && shown.rendering === "pixelated",
      `the full-size view: ${JSON.stringify(shown)}`);
    await shot("intermediate-image-full-size");
    await page.keyboard.press("Escape"); // closes, as a click anywhere does
    await page.waitForSelector(tid("lightbox"), { state: "detached", timeout: 5_000 });
    await page.click(thumb);
    await page.click(tid("lightbox"));
    await page.waitForSelector(tid("lightbox"), { state: "detached" });
    // The tone its `voice` node makes, which no node takes: a player.
    const audio = tid("media-audio-voice.sound");
    await page.waitForSelector(audio);
    await page.waitForFunction((s) => document.querySelector(s)?.readyState >= 1, audio);
    const seconds = await page.$eval(audio, (a) => a.duration);
    expect(seconds > 0.3 && seconds < 0.5, `the node's WAV plays in a player (${seconds} s)`);
  });

  await step("the run ends: the reply reads as text, each node says where it ran", async () => {
    await waitText(tid("run-status"), "done", 90_000);
    const story = page.locator(`${tid("output-story")} .output-text`);
    await story.waitFor();
    const text = (await story.textContent()) ?? "";
    expect(text.length > 100 && !text.trim().startsWith("["), `the story reads as text: ${text.slice(0, 80)}`);
    await noNegativeTimes();
    // Live and final times agree: the reply's last live reading (the view ticks every 250 ms) is within
    // 1 s of the time it ends with. They part by at most a tick plus the time its `done` event takes to
    // reach the page (stored, published, sent: a few hundred ms on a busy 2-core machine); an attempt's
    // time counted wrong (from the wrong event, or on the browser's clock) parts them by far more.
    await page.waitForFunction(() => window.__replyTimes.at(-1)?.state === "done");
    const samples = await page.evaluate(() => window.__replyTimes);
    const live = samples.filter((x) => x.state === "running").map((x) => parseTime(x.text)).filter((t) => t !== null);
    const shown = parseTime(samples.at(-1).text);
    const reported = (await runDetail(firstRun)).nodes.find((n) => n.node === "reply").duration_ms;
    expect(live.length > 10 && live.every((t, i) => i === 0 || t >= live[i - 1]),
      `the live time only counts up: ${JSON.stringify(live.slice(-5))}`);
    const resolution = reported < 60_000 ? 10 : 500; // "5.12 s", or "1 min 3 s" past a minute
    expect(Math.abs(shown - reported) <= resolution, `the final time shown (${shown} ms) is the server's (${reported} ms)`);
    expect(Math.abs(live.at(-1) - reported) <= 1000,
      `the last live time (${live.at(-1)} ms) agrees with the final one (${reported} ms)`);
    console.log(`     reply: last live ${live.at(-1)} ms, final ${reported} ms`);
    await page.click(`${tid("node-table")} td.mono >> text=reply`);
    await page.waitForSelector(tid("node-where"));
    const where = (await page.textContent(tid("node-where"))) ?? "";
    expect(/\S+ on \S+/.test(where), `the node says where it ran: ${where}`);
    const body = (await page.textContent("body")) ?? "";
    expect(!DATA_DIR || !body.includes(DATA_DIR), "no server path on the run page");
    const detail = await runDetail(firstRun);
    const nodeFiles = detail.files.filter((f) => f.role === "node");
    const kinds = nodeFiles.map((f) => `${f.name}:${f.content_type}`).sort();
    expect(JSON.stringify(kinds) === JSON.stringify(["paint.picture:image/png", "voice.sound:audio/wav"]),
      `the node image and tone kept: ${JSON.stringify(kinds)}`);
    await shot("run-watch-done");
  });

  await step("Run again starts from the previous run's inputs; the runs list shows it live and cancels it", async () => {
    const list = await context.newPage();
    await list.goto(`${BASE}/runs`);
    await list.waitForSelector(tid("runs-table"));
    await list.evaluate(() => {
      window.__notReloaded = true;
    });
    const before = await list.locator(tid("run-row")).count();
    await page.click(tid("run-again"));
    await page.waitForSelector(tid("run-again-from"));
    await page.waitForFunction((s) => document.querySelector(s)?.value !== "", `${tid("input-caption")} textarea`);
    const caption = await page.inputValue(`${tid("input-caption")} textarea`);
    expect(caption === CAPTION, `the caption starts from the previous run's: "${caption}"`);
    await shot("run-again-form");
    await page.click(tid("submit-run"));
    await page.waitForURL((url) => url.pathname.startsWith("/runs/") && !url.pathname.includes(firstRun));
    const second = runIdOf(page.url());
    expect((await runDetail(second)).inputs.caption === CAPTION, "the new run has the previous run's inputs");
    // The other tab, never reloaded, lists it as it runs.
    const row = `${tid("run-row")}:has(a[href="/runs/${second}"])`;
    await list.waitForSelector(`${row}[data-status="running"], ${row}[data-status="pending"]`, { timeout: 10_000 });
    expect((await list.locator(tid("run-row")).count()) === before + 1, "one more row");
    // The studio runs two at a time (OMNIFLOW_MAX_RUNS=2): two more of the same, and the last waits
    // in the queue, its place in its row, and leaves it when cancelled there.
    const more = await list.evaluate(async ({ workflow, inputs }) => {
      const { csrf_token: csrf } = await (await fetch("/api/auth/session/")).json();
      const post = async () => (await fetch("/api/runs/", {
        method: "POST", headers: { "Content-Type": "application/json", "X-CSRFToken": csrf },
        body: JSON.stringify({ workflow, inputs }),
      })).json();
      return [(await post()).id, (await post()).id];
    }, { workflow: (await runDetail(second)).workflow, inputs: { caption: CAPTION } });
    const queued = `${tid("run-row")}:has(a[href="/runs/${more[1]}"])`;
    await list.waitForSelector(`${queued}[data-status="pending"] ${tid("queue-position")}`, { timeout: 10_000 });
    const place = (await list.textContent(`${queued} ${tid("queue-position")}`)).trim();
    expect(place === "#1 in the queue", `the waiting run's place: ${place}`);
    await list.bringToFront();
    await shot("runs-list-live", list);
    await list.click(`${queued} ${tid("cancel-row")}`);
    await list.waitForSelector(`${queued}[data-status="cancelled"]`, { timeout: 15_000 });
    const third = `${tid("run-row")}:has(a[href="/runs/${more[0]}"])`;
    await list.click(`${third} ${tid("cancel-row")}`);
    await list.waitForSelector(`${third}[data-status="cancelled"]`, { timeout: 15_000 });
    await list.click(`${row} ${tid("cancel-row")}`);
    await list.waitForSelector(`${row}[data-status="cancelled"]`, { timeout: 15_000 });
    expect(await list.evaluate(() => window.__notReloaded === true), "the runs list was never reloaded");
    await shot("runs-list-cancelled", list);
    await list.close();
  });

  // The login page's session probe answers 401 before the login: expected, as in studio.e2e.mjs.
  expectQuietConsole(/status of 401|Failed to load resource: the server responded with a status of 401/);
} finally {
  await finish();
}
