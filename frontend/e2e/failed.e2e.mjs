// A worker that cannot start, in a real Chromium driven by Playwright, against a live studio.
//
//   STUDIO_URL=... STUDIO_USER=... STUDIO_PASSWORD=... E2E_ARTIFACTS=... E2E_FIXTURES=<tests/e2e/workflows>
//   node e2e/failed.e2e.mjs
//
// tests/e2e/test_ux_e2e.py runs it against the studio of tests/e2e/conftest.py: a workflow whose llm
// role names a checkpoint folder with a config and no weights (it passes validation: the folder is
// there) is imported and deployed from the editor; its worker starts and exits before it registers.
// The deploy dialog and the deployment view show that worker's row failed, with the reason.
// Every step leaves a screenshot in E2E_ARTIFACTS; a failing one FAILED-<step>.png, and exits 1.

import { readFileSync, writeFileSync } from "node:fs";
import { join, resolve } from "node:path";

import { expect, logIn, openBrowser, tid, validityShows } from "./harness.mjs";

const BASE = process.env.STUDIO_URL ?? "http://127.0.0.1:8000";
const USER = process.env.STUDIO_USER ?? "demo";
const PASSWORD = process.env.STUDIO_PASSWORD ?? "demo";
const FIXTURES = resolve(process.env.E2E_FIXTURES ?? "../tests/e2e/workflows");
const WAIT = 30_000;
const FAILED_ROW = `${tid("deployment-worker")}[data-role="lm"][data-state="failed"]`;
const REASON = /before it was ready: ModelLoadError: .*no file named model\.safetensors/;

const { page, ART, shot, step, waitText, expectQuietConsole, finish } = await openBrowser("failed", { wait: WAIT });

/** The failed row's worker id and the reason it shows (its first line; the whole text is its title). */
async function failedRow(scope) {
  const row = page.locator(`${scope} ${FAILED_ROW}`);
  const error = row.locator(tid("worker-error"));
  return { worker: await row.getAttribute("data-worker"), shown: (await error.textContent()).trim(),
           full: await error.getAttribute("title") };
}

let deploymentPath = "";
let worker = "";

try {
  await step("login", () => logIn(page, BASE, USER, PASSWORD));

  await step("import a workflow whose model has no weights: it validates", async () => {
    await page.goto(`${BASE}/workflows`);
    await page.click(tid("import-workflow"));
    await page.fill('textarea[aria-label="GraphSpec JSON or Python DSL source"]',
      readFileSync(join(FIXTURES, "no_weights.json"), "utf8"));
    await page.click(tid("import-submit"));
    await page.waitForSelector(tid("editor"));
    await waitText(tid("editor-name"), "e2e-no-weights");
    await validityShows(page, "Valid");
    await shot("editor-no-weights-valid");
  });

  await step("deploy it: the dialog shows its worker failed, with why", async () => {
    await page.click(tid("deploy"));
    await page.waitForSelector(tid("deploy-submit"));
    await page.click(tid("deploy-submit"));
    await page.waitForSelector(tid("focused-deployment"));
    await page.waitForSelector(`${tid("deployment-row")}[data-name="e2e-no-weights"][data-status="failed"]`,
      { timeout: 120_000 });
    await page.waitForSelector(`${tid("focused-deployment")} ${FAILED_ROW}`);
    const { worker: id, shown, full } = await failedRow(tid("focused-deployment"));
    worker = id;
    expect(/-lm-\d+-\d+$/.test(worker ?? ""), `the failed row is the worker's own (not a placeholder): ${worker}`);
    expect(full.includes(worker), `the row's reason names its worker: ${full}`);
    // Why, in the line the row shows: the worker's own words, not "see standard error".
    expect(REASON.test(shown), `the row shows why it failed: ${shown}`);
    await page.waitForFunction((s) => document.querySelectorAll(s).length === 1,
      `${tid("focused-deployment")} ${tid("deployment-worker")}`);
    await shot("deploy-dialog-worker-failed");
    deploymentPath = await page.getAttribute(
      `${tid("deployment-row")}[data-name="e2e-no-weights"] ${tid("deployment-open")}`, "href");
  });

  await step("the deployment view shows the failed row and its reason", async () => {
    await page.goto(`${BASE}${deploymentPath}`);
    await page.waitForSelector(tid("deployment-page"));
    await waitText(tid("deployment-name"), "e2e-no-weights");
    await page.waitForSelector(`${tid("deployment-page")} ${FAILED_ROW}`);
    const { worker: id, shown, full } = await failedRow(tid("deployment-page"));
    expect(id === worker, `the same row as in the dialog: ${id}, ${worker}`);
    expect(REASON.test(shown) && full.startsWith(shown), `the view's reason: ${full}`);
    expect((await page.locator(`${tid("deployment-page")} ${tid("deployment-worker")}`).count()) === 1,
      "one row: the failed worker, no placeholder for a deployment that ended");
    await waitText(tid("workers-up"), "0 up");
    writeFileSync(join(ART, "worker-error.txt"), `${shown}\n\n${full}\n`);
    await shot("deployment-view-worker-failed");
  });

  expectQuietConsole();
} finally {
  await finish();
}
