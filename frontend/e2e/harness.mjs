// What every browser test script shares: a headless Debian Chromium driven by Playwright, in a
// profile of its own (removed by close()), with the page's console errors collected, numbered
// screenshots in E2E_ARTIFACTS (default e2e-artifacts), and named steps that log "ok"/"FAIL" and
// leave FAILED-<step>.png when they throw.

import { mkdirSync, mkdtempSync, rmSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join, resolve } from "node:path";
import { chromium } from "playwright-core";

export const tid = (id) => `[data-testid="${id}"]`;

export function expect(cond, message) {
  if (!cond) throw new Error(message);
}

/**
 * A browser for the script `name`: { context, page, ART, consoleErrors, results, shot, step,
 * waitText, shotCount, expectQuietConsole, close, finish }. Options: `viewport`, `wait` (the default timeout, ms),
 * `fullPage` screenshots, `acceptDownloads`, `clipboardOrigin` (granted clipboard access).
 */
export async function openBrowser(name, { viewport = { width: 1440, height: 960 }, wait = 30_000, fullPage = false,
                                          acceptDownloads = false, clipboardOrigin = null } = {}) {
  const ART = resolve(process.env.E2E_ARTIFACTS ?? "e2e-artifacts");
  mkdirSync(ART, { recursive: true });
  const profile = mkdtempSync(join(tmpdir(), `omniflow-e2e-${name}-`));
  const context = await chromium.launchPersistentContext(profile, {
    executablePath: process.env.CHROMIUM ?? "/usr/bin/chromium",
    headless: true,
    args: ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
           "--disable-background-networking", "--disable-component-update", "--disable-sync"],
    viewport,
    acceptDownloads,
  });
  context.setDefaultTimeout(wait);
  if (clipboardOrigin) await context.grantPermissions(["clipboard-read", "clipboard-write"], { origin: clipboardOrigin });
  const page = context.pages()[0] ?? (await context.newPage());
  const consoleErrors = [];
  page.on("console", (m) => m.type() === "error" && consoleErrors.push(m.text()));
  page.on("pageerror", (e) => consoleErrors.push(String(e)));

  let shots = 0;
  // Finished animations (modals fading in, toasts sliding): each picture shows the settled page.
  const shot = async (label, on = page) => {
    shots += 1;
    await on.screenshot({ path: join(ART, `${String(shots).padStart(2, "0")}-${label}.png`), fullPage,
                          animations: "disabled" });
  };
  const results = [];
  async function step(label, fn) {
    const t0 = Date.now();
    try {
      await fn();
      results.push({ name: label, ok: true, ms: Date.now() - t0 });
      console.log(`ok   ${label} (${Date.now() - t0} ms)`);
    } catch (err) {
      results.push({ name: label, ok: false, ms: Date.now() - t0 });
      console.log(`FAIL ${label}: ${err.stack ?? err}`);
      await page.screenshot({ path: join(ART, `FAILED-${label}.png`), fullPage }).catch(() => {});
      throw err;
    }
  }
  async function waitText(selector, text, timeout = wait, on = page) {
    await on.waitForFunction(([s, t]) => document.querySelector(s)?.textContent?.includes(t), [selector, text],
                             { timeout });
  }
  /** Fail on the page's console errors but those `expected` matches (by default: the 4xx answers it probes with). */
  function expectQuietConsole(expected = /status of 40[0-9]|Failed to load resource/) {
    const unexpected = consoleErrors.filter((e) => !expected.test(e));
    expect(unexpected.length === 0, `console errors: ${unexpected.join(" | ")}`);
  }
  async function close() {
    await context.close();
    rmSync(profile, { recursive: true, force: true });
  }
  /** Close, leaving steps.json (each step, the console errors) beside the screenshots. */
  async function finish() {
    writeFileSync(join(ART, "steps.json"), JSON.stringify({ results, consoleErrors }, null, 2));
    await close();
    console.log(`${results.filter((r) => r.ok).length} of ${results.length} steps passed, ${shots} screenshots in ${ART}`);
  }
  return { context, page, ART, consoleErrors, results, shot, step, waitText, shotCount: () => shots,
           expectQuietConsole, close, finish };
}

/** Drag from one port handle to another with the mouse, as a user connects ports. */
export async function dragPorts(page, from, to) {
  const center = async (selector) => {
    const box = await page.locator(selector).first().boundingBox();
    expect(box, `${selector} is not on screen`);
    return { x: box.x + box.width / 2, y: box.y + box.height / 2 };
  };
  const a = await center(from);
  const b = await center(to);
  await page.mouse.move(a.x, a.y);
  await page.mouse.down();
  await page.mouse.move((a.x + b.x) / 2, (a.y + b.y) / 2, { steps: 8 });
  await page.mouse.move(b.x, b.y, { steps: 8 });
  await page.mouse.up();
}

/** Wait until React Flow's viewport stops moving (an animated pan or zoom has ended), so a click
 * lands on the node it aims at and not where the node was a frame ago. */
export async function viewportSettled(page, timeout = 15_000) {
  await page.waitForFunction(
    () =>
      new Promise((resolve) => {
        const view = document.querySelector(".react-flow__viewport");
        if (!view) return resolve(true);
        const before = view.style.transform;
        setTimeout(() => resolve(view.style.transform === before), 200);
      }),
    null,
    { timeout, polling: 50 },
  );
}

/** The bounding box of `locator`'s element once it holds still: its own animations (a toast sliding in)
 * have finished and its box is the same over two animation frames. A box read mid-animation is where
 * the element passes through, not where it stays. Fails after `timeout` ms of movement. */
export async function settledBox(locator, timeout = 5_000) {
  await locator.evaluate(async (el, limit) => {
    const frame = () => new Promise((resolve) => requestAnimationFrame(resolve));
    const endless = el.getAnimations().filter((a) => a.effect?.getComputedTiming().endTime === Infinity);
    if (endless.length > 0) throw new Error(`${el.className} runs an endless animation: its box never settles`);
    await Promise.all(el.getAnimations().map((a) => a.finished));
    const read = () => JSON.stringify(el.getBoundingClientRect());
    const deadline = performance.now() + limit;
    let last = read();
    for (;;) {
      await frame();
      await frame();
      const now = read();
      if (now === last) return;
      if (performance.now() > deadline) throw new Error(`${el.className} still moves after ${limit} ms: ${now}`);
      last = now;
    }
  }, timeout);
  return locator.boundingBox();
}

/** Log in on the studio's login page; the workflows list opens. */
export async function logIn(page, base, user, password) {
  await page.goto(`${base}/login`);
  await page.fill('input[name="username"]', user);
  await page.fill('input[name="password"]', password);
  await page.click('button[type="submit"]');
  await page.waitForURL(/\/workflows$/);
}

/** Wait until the editor's validity pill shows `text` for the current document (no check in flight). */
export async function validityShows(page, text, timeout) {
  await page.waitForFunction(
    ([s, t]) => {
      const pill = document.querySelector(s);
      return pill?.dataset.checking === "false" && pill.textContent.includes(t);
    },
    [tid("validity"), text],
    timeout === undefined ? {} : { timeout },
  );
}
