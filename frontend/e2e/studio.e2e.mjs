// The studio in a real Chromium, driven by Playwright, against a live studio.
//
//   STUDIO_URL=http://127.0.0.1:8000 STUDIO_USER=demo STUDIO_PASSWORD=demo \
//   E2E_ARTIFACTS=../tests/e2e/artifacts/studio E2E_FIXTURES=../tests/e2e/workflows node e2e/studio.e2e.mjs
//
// tests/e2e/test_studio_e2e.py starts the studio (with `tests.e2e.fns` among the allowed
// op modules and the demo workflows loaded) and runs this script. Every page gets a
// screenshot in E2E_ARTIFACTS; a failing step leaves FAILED-<step>.png and exits 1.
// CHROMIUM names the browser (default /usr/bin/chromium, Debian's package).

import { readFileSync } from "node:fs";
import { join, resolve } from "node:path";

import { dragPorts, expect, openBrowser, tid, validityShows, viewportSettled } from "./harness.mjs";

const BASE = process.env.STUDIO_URL ?? "http://127.0.0.1:8000";
const USER = process.env.STUDIO_USER ?? "demo";
const PASSWORD = process.env.STUDIO_PASSWORD ?? "demo";
const FIXTURES = resolve(process.env.E2E_FIXTURES ?? "../tests/e2e/workflows");
const WAIT = 15_000;
const SQUARES_DESCRIPTION = "squares a number, built in the browser test";

const { page, shot, step, waitText, expectQuietConsole, finish } = await openBrowser(
  "studio", { viewport: { width: 1600, height: 1000 }, wait: WAIT, acceptDownloads: true });
async function selectNode(id) {
  await viewportSettled(page); // a pan to an issue's node may still be under way
  await page.locator(`${tid(`node-${id}`)} .spec-node-id`).click();
  await page.waitForSelector(tid("node-inspector"));
}
async function setField(selector, value) {
  const input = page.locator(selector);
  await input.fill(value);
  await input.press("Enter");
}
const validity = (text) => validityShows(page, text, WAIT);
/** Click an empty spot of the canvas: deselects, and takes focus out of the side panel. */
async function clickPane() {
  const box = await page.locator(".react-flow__pane").boundingBox();
  await page.mouse.click(box.x + box.width / 2, box.y + box.height - 30);
}
async function openWorkflow(name) {
  await page.goto(`${BASE}/workflows`);
  await page.locator(`${tid(`workflow-row-${name}`)} .row-title`).click();
  await page.waitForSelector(tid("editor"));
}
async function waitRunStatus(status, timeout = 30_000) {
  await waitText(tid("run-status"), status, timeout);
}

const workflowIds = {};
/** The run shown on the run page, as the API returns it. */
async function runDetail() {
  const id = page.url().split("/").pop();
  return page.evaluate(async (runId) => (await fetch(`/api/runs/${runId}/`)).json(), id);
}
/** When the run on the run page finished, in epoch seconds. */
async function finishedAt() {
  const run = await runDetail();
  expect(run.finished_at, `run ${run.id} has not finished`);
  return Date.parse(run.finished_at) / 1000;
}
/** Submit a run of the workflow's defaults on its (one) running deployment; wait for it to end done. */
async function runOnDeployment(workflowId) {
  await page.goto(`${BASE}/workflows/${workflowId}/run`);
  await page.waitForSelector(tid("run-form"));
  await page.waitForSelector(`${tid("run-target")} option:nth-child(2)`, { state: "attached" });
  await page.selectOption(tid("run-target"), { index: 1 });
  await page.waitForSelector(`${tid("run-version")}:disabled`);
  await page.click(tid("submit-run"));
  await page.waitForSelector(tid("run-page"));
  await page.waitForFunction((s) => /done|failed|cancelled/.test(document.querySelector(s)?.textContent ?? ""),
    tid("run-status"), { timeout: 60_000 });
  const run = await runDetail();
  expect(run.status === "done", `the run ended ${run.status}: ${run.error}`);
  return run;
}
/** The cluster page's device hit rate once the llm worker's metrics postdate `after` (epoch s). */
async function hitRateAfter(after) {
  await page.goto(`${BASE}/cluster`);
  await page.waitForFunction(
    (t) => [...document.querySelectorAll('[data-testid="worker-row"][data-role="llm"]')]
      .some((row) => Number(row.dataset.heartbeat) > t),
    after,
  );
  return Number(await page.getAttribute(tid("chart-hit-rate-device"), "data-value"));
}


try {
  await step("login", async () => {
    await page.goto(`${BASE}/workflows`);
    await page.waitForURL(/\/login/);
    await page.waitForSelector('form[aria-label="Sign in"]');
    await shot("login");
    await page.fill('input[name="username"]', USER);
    await page.fill('input[name="password"]', "wrong password");
    await page.click('button[type="submit"]');
    await page.waitForSelector('[role="alert"]');
    await page.fill('input[name="password"]', PASSWORD);
    await page.click('button[type="submit"]');
    await page.waitForURL(/\/workflows$/);
    await waitText(tid("current-user"), USER);
  });

  await step("workflows list and search", async () => {
    for (const name of ["diamond", "loop", "router", "stream"]) await page.waitForSelector(tid(`workflow-row-${name}`));
    await shot("workflows");
    await page.fill('input[aria-label="Search workflows"]', "diamo");
    await page.waitForFunction(() => document.querySelectorAll('[data-testid^="workflow-row-"]').length === 1);
    expect(await page.locator(tid("workflow-row-diamond")).count(), "search hides diamond");
    await page.fill('input[aria-label="Search workflows"]', "");
    await page.waitForSelector(tid("workflow-row-loop"));
  });

  await step("create a workflow", async () => {
    await page.click(tid("new-workflow"));
    await page.fill(`${tid("create-dialog")} input[name="name"]`, "e2e-squares");
    await page.fill(`${tid("create-dialog")} textarea`, SQUARES_DESCRIPTION);
    await shot("create-dialog");
    await page.click(tid("create-submit"));
    await page.waitForSelector(tid("editor"));
    workflowIds.squares = page.url().split("/").pop();
    await waitText(tid("editor-name"), "e2e-squares");
    // The description the dialog was given is the draft's: the Workflow tab shows it (the first save keeps it).
    const description = await page.locator(tid("workflow-panel")).getByLabel("Description").inputValue();
    expect(description === SQUARES_DESCRIPTION, `the editor's Description reads "${description}"`);
    await page.waitForSelector(tid("palette-python"));
    await shot("editor-empty");
  });

  await step("drag nodes from the palette", async () => {
    const canvas = tid("canvas");
    await page.dragAndDrop(tid("palette-input"), canvas, { targetPosition: { x: 140, y: 110 } });
    await page.waitForSelector(tid("node-input"));
    await page.dragAndDrop(tid("palette-python"), canvas, { targetPosition: { x: 420, y: 300 } });
    await page.waitForSelector(tid("node-python"));
    await page.dragAndDrop(tid("palette-output"), canvas, { targetPosition: { x: 640, y: 130 } });
    await page.waitForSelector(tid("node-output"));
    expect((await page.locator(".react-flow__node").count()) === 3, "three nodes on the canvas");
  });

  await step("rename the function node", async () => {
    await selectNode("python");
    await setField(tid("node-id-input"), "square");
    await page.waitForSelector(tid("node-square"));
  });

  await step("incompatible ports are refused with a hint", async () => {
    await selectNode("input");
    await page.selectOption(`${tid("ports-outputs")} select[aria-label="value type"]`, "image");
    await waitText(`${tid("node-input")} .port-out`, "image");
    await dragPorts(page, tid("port-input-out-value"), tid("port-square-in-x"));
    await waitText(tid("connect-hint"), "Type mismatch");
    await waitText(tid("connect-hint"), "expects json");
    expect((await page.locator(".react-flow__edge").count()) === 0, "the refused edge was not added");
    await shot("editor-refused-connection");
  });

  await step("connect typed ports", async () => {
    await selectNode("input");
    await page.selectOption(`${tid("ports-outputs")} select[aria-label="value type"]`, "json");
    await waitText(`${tid("node-input")} .port-out`, "json");
    await dragPorts(page, tid("port-input-out-value"), tid("port-square-in-x"));
    await page.waitForSelector('[data-testid="rf__edge-input.value->square.x"]');
    await dragPorts(page, tid("port-square-out-out"), tid("port-output-in-value"));
    await page.waitForSelector('[data-testid="rf__edge-square.out->output.value"]');
  });

  await step("a validation error is shown on the node it names", async () => {
    await validity("1 issue");
    await page.waitForSelector(`${tid("node-square")}.has-issues`);
    await waitText(`${tid("node-square")} ${tid("node-issue")}`, "needs an op");
    expect((await page.locator(".spec-node.has-issues").count()) === 1, "only the node without an op is marked");
    await clickPane();
    await shot("editor-validation-error");
    await page.click(tid("tab-issues"));
    await waitText(tid("issues-panel"), "missing_op");
    await page.locator(`${tid("issues-panel")} .issue-item`).first().click();
    await page.waitForSelector(tid("node-inspector"));
  });

  await step("fix it", async () => {
    await selectNode("square");
    await page.selectOption(tid("node-op-select"), "diamond.square"); // the registered ops' picker
    await validity("Valid");
    expect((await page.locator(".spec-node.has-issues").count()) === 0, "no node is marked after the fix");
  });

  await step("undo and redo", async () => {
    await clickPane();
    await page.keyboard.press("Control+z");
    await validity("1 issue");
    await page.waitForSelector(`${tid("node-square")}.has-issues`);
    await page.keyboard.press("Control+Shift+z");
    await validity("Valid");
    await page.click('button[aria-label="Undo"]');
    await validity("1 issue");
    await page.click('button[aria-label="Redo"]');
    await validity("Valid");
  });

  await step("auto-layout and save version 1", async () => {
    await page.click('button:has-text("Auto-layout")');
    await page.waitForTimeout(400);
    await page.click(tid("save"));
    await page.fill(tid("save-message"), "squares from the browser test");
    await shot("editor-save-dialog");
    await page.click(tid("save-submit"));
    await waitText(".toasts", "Saved version 1");
    await waitText(".editor-sub", "v1");
    expect((await page.locator(tid("dirty")).count()) === 0, "saved: nothing unsaved");
    await shot("editor-saved");
  });

  await step("rename the output and save version 2", async () => {
    await selectNode("output");
    await setField(tid("node-id-input"), "result");
    await page.waitForSelector(tid("node-result"));
    await page.waitForSelector(tid("dirty"));
    const asked = new Promise((resolve) => page.once("dialog", (d) => resolve(d.dismiss())));
    await page.click('a[aria-label="Back to workflows"]');
    await asked; // leaving with unsaved edits asks first; dismissed, the editor stays
    expect(page.url().endsWith(`/workflows/${workflowIds.squares}`), "stayed in the editor");
    // Run opens the run form of the saved v1: it asks the same way before the edits are left behind.
    const runAsked = page.waitForEvent("dialog", { timeout: 5_000 }).then(async (d) => {
      const text = d.message();
      await d.dismiss();
      return text;
    });
    await page.click(tid("run"));
    const question = await runAsked;
    expect(question.includes("saved version v1") && question.includes("unsaved changes will be lost"), `Run asks: ${question}`);
    expect(page.url().endsWith(`/workflows/${workflowIds.squares}`), "Run dismissed: stayed in the editor");
    await page.waitForSelector(tid("node-result")); // the edit is still there
    await page.waitForSelector(tid("dirty"));
    await page.keyboard.press("Control+s");
    await page.fill(tid("save-message"), "rename the output");
    await page.click(tid("save-submit"));
    await waitText(".editor-sub", "v2");
  });

  await step("version history with a diff", async () => {
    await page.click('button:has-text("History")');
    await page.waitForSelector(tid("version-2"));
    await page.waitForSelector(tid("version-1"));
    await waitText(tid("version-diff"), "+ result");
    await waitText(tid("version-diff"), "− output");
    await waitText(`${tid("version-diff")} .unified`, '"id": "result"');
    await shot("history-diff");
    await page.keyboard.press("Escape");
  });

  await step("export JSON and Python", async () => {
    await page.click(tid("export-menu"));
    const [download] = await Promise.all([page.waitForEvent("download"), page.click(tid("export-json"))]);
    const spec = JSON.parse(readFileSync(await download.path(), "utf8"));
    expect(spec.name === "e2e-squares", `exported spec is named ${spec.name}`);
    expect(spec.description === SQUARES_DESCRIPTION, `the saved spec's description: ${spec.description}`);
    expect(spec.nodes.map((n) => n.id).join(",") === "input,square,result", "exported nodes");
    expect(download.suggestedFilename() === "e2e-squares-v2.json", download.suggestedFilename());
    await page.click(tid("export-menu"));
    const [pyDownload] = await Promise.all([page.waitForEvent("download"), page.click(tid("export-python"))]);
    const source = readFileSync(await pyDownload.path(), "utf8");
    expect(source.includes("Workflow('e2e-squares'"), "the Python export builds the workflow");
    await page.click(tid("export-menu"));
    await page.click(tid("view-python"));
    await waitText(tid("python-source"), "wf.edge('square.out', 'result.value')");
    await shot("export-python");
    await page.keyboard.press("Escape");
  });

  await step("deploy the saved version onto role workers, then stop it", async () => {
    await page.click(tid("deploy"));
    await page.waitForSelector(tid("deploy-submit"));
    const hint = await page.textContent(tid("deploy-name-hint"));
    expect(!hint.includes("OpenAI"), `a workflow that is not chat names no OpenAI model: ${hint}`);
    await shot("deploy");
    await page.click(tid("deploy-submit"));
    await page.waitForSelector('[data-testid="deployment-row"][data-status="running"]', { timeout: 120000 });
    await shot("deploy-running");
    await page.click(tid("deployment-stop"));
    await page.waitForSelector('[data-testid="deployment-row"][data-status="stopped"]', { timeout: 60000 });
    await page.keyboard.press("Escape");
  });

  await step("roles panel", async () => {
    await page.click(tid("tab-roles"));
    await page.waitForSelector(tid("role-python"));
    await shot("editor-roles");
  });

  await step("run the new workflow", async () => {
    await page.click(tid("run"));
    await page.waitForSelector(tid("run-form"));
    await page.fill(`${tid("input-input")} textarea`, "7");
    await page.click(tid("submit-run"));
    await page.waitForSelector(tid("run-page"));
    await waitRunStatus("done");
    await waitText(tid("output-result"), "49");
  });

  await step("a run aimed at a deployment that is not running is refused, not run elsewhere", async () => {
    const { workflow } = await runDetail();
    const before = (await page.evaluate(async () => (await fetch("/api/runs/")).json())).count;
    await page.goto(`${BASE}/workflows/${workflow}/run?deployment=00000000-0000-0000-0000-000000000000`);
    await page.waitForSelector(tid("run-form"));
    await waitText('[role="alert"]', "is not running for this workflow");
    await page.waitForSelector(`${tid("submit-run")}:disabled`);
    await shot("run-form-deployment-not-running");
    await page.selectOption(tid("run-target"), "");
    await page.waitForSelector(`${tid("submit-run")}:enabled`);
    const after = (await page.evaluate(async () => (await fetch("/api/runs/")).json())).count;
    expect(after === before, `a run was submitted anyway (${before} -> ${after})`);
  });

  await step("run diamond.py with inputs", async () => {
    await openWorkflow("diamond");
    await shot("editor-diamond");
    await page.click(tid("run"));
    await page.waitForSelector(tid("run-form"));
    await page.fill(`${tid("input-n")} textarea`, "5");
    await shot("run-form");
    await page.click(tid("submit-run"));
    await waitRunStatus("done");
    await waitText(tid("output-sum"), "150");
    for (const node of ["n", "square", "cube", "total", "sum"]) {
      await page.waitForSelector(`${tid(`node-${node}`)}[data-state="done"]`);
    }
    await shot("run-diamond-done");
  });

  await step("import a GraphSpec file and watch images and streamed text arrive", async () => {
    await page.goto(`${BASE}/workflows`);
    await page.click(tid("import-workflow"));
    await page.setInputFiles(tid("import-file"), join(FIXTURES, "media.json"));
    await shot("import-dialog");
    await page.click(tid("import-submit"));
    await page.waitForSelector(tid("editor"));
    await waitText(tid("editor-name"), "e2e-media");
    await validity("Valid");
    await page.click(tid("run"));
    await page.waitForSelector(tid("run-form"));
    await page.setInputFiles(`${tid("input-picture")} input[type="file"]`, process.env.E2E_PICTURE);
    await page.waitForSelector(`${tid("input-picture")} img.input-preview`);
    await page.fill(`${tid("input-caption")} textarea`, "frames arrive one by one in the browser");
    await shot("run-form-upload");
    await page.click(tid("submit-run"));
    await page.waitForSelector(tid("run-page"));
    await waitText(tid("run-streams"), "frames arrive");
    await waitRunStatus("done");
    const img = page.locator(tid("output-image-image"));
    await img.waitFor();
    await page.waitForFunction((s) => document.querySelector(s)?.naturalWidth === 96, tid("output-image-image"));
    await waitText(tid("output-text"), "frames arrive one by one in the browser");
    const audio = page.locator(tid("output-audio-sound"));
    await audio.waitFor();
    await page.waitForFunction((s) => document.querySelector(s)?.readyState >= 1, tid("output-audio-sound"));
    expect((await audio.evaluate((a) => a.duration)) > 0.3, "the WAV output plays in an audio player");
    await shot("run-media-done");
  });

  await step("watch states change live, then cancel", async () => {
    await page.goto(`${BASE}/workflows`);
    await page.click(tid("import-workflow"));
    await page.fill('textarea[aria-label="GraphSpec JSON or Python DSL source"]', readFileSync(join(FIXTURES, "slow.json"), "utf8"));
    await page.click(tid("import-submit"));
    await page.waitForSelector(tid("editor"));
    await page.click(tid("run"));
    await page.waitForSelector(tid("run-form"));
    await page.click(tid("submit-run"));
    await page.waitForSelector(tid("run-page"));
    await page.waitForSelector(`${tid("node-warm")}[data-state="running"]`);
    await shot("run-live-running");
    await page.waitForSelector(`${tid("node-warm")}[data-state="done"]`);
    await page.waitForSelector(`${tid("node-hold")}[data-state="running"]`);
    await waitRunStatus("running");
    await shot("run-live-second-node");
    await page.click(tid("cancel-run"));
    await waitRunStatus("cancelled");
    await page.waitForSelector(`${tid("node-hold")}[data-state="cancelled"]`);
    await shot("run-cancelled");
  });

  await step("import Python DSL source, then delete it", async () => {
    await page.goto(`${BASE}/workflows`);
    await page.click(tid("import-workflow"));
    await page.fill('textarea[aria-label="GraphSpec JSON or Python DSL source"]', readFileSync(join(FIXTURES, "echo_dsl.py"), "utf8"));
    await page.click(tid("import-submit"));
    await page.waitForSelector(tid("editor"));
    await waitText(tid("editor-name"), "e2e-dsl");
    await page.waitForSelector(tid("node-shout"));
    await page.goto(`${BASE}/workflows`);
    await page.click(`${tid("workflow-row-e2e-dsl")} button[aria-label="Delete e2e-dsl"]`);
    await shot("delete-confirm");
    await page.click(tid("confirm-delete"));
    await page.waitForSelector(tid("workflow-row-e2e-dsl"), { state: "detached" });
    await shot("workflows-after");
  });

  await step("runs list", async () => {
    await page.goto(`${BASE}/runs`);
    await page.waitForSelector(tid("runs-table"));
    expect((await page.locator(tid("run-row")).count()) >= 4, "every run is listed");
    await shot("runs");
    await page.selectOption('select[aria-label="Filter by status"]', "cancelled");
    // Only cancelled runs listed (this test's one, and any other test's in the same studio).
    await page.waitForFunction(() => {
      const rows = [...document.querySelectorAll('[data-testid="run-row"]')];
      return rows.length >= 1 && rows.every((r) => r.dataset.status === "cancelled");
    });
  });

  await step("cluster view lists the studio's workers", async () => {
    await page.goto(`${BASE}/cluster`);
    await page.waitForSelector(tid("workers-table"));
    await shot("cluster");
  });

  await step("run the image-generation workflow on role workers and see its PNG", async () => {
    await openWorkflow("image_generation");
    workflowIds.imageGeneration = page.url().split("/").pop();
    await page.click(tid("deploy"));
    await page.click(tid("deploy-submit"));
    await page.waitForSelector('[data-testid="deployment-row"][data-status="running"]', { timeout: 120_000 });
    await page.keyboard.press("Escape");
    const run = await runOnDeployment(workflowIds.imageGeneration);
    expect(run.deployment, "the run went to the deployment's workers");
    await page.waitForSelector(`${tid("run-deployment")} a[href="/deployments/${run.deployment}"]`);
    const img = page.locator(tid("output-image-image"));
    await img.waitFor();
    await page.waitForFunction((s) => document.querySelector(s)?.naturalWidth > 0, tid("output-image-image"));
    const shown = await img.evaluate((el) => ({ width: el.naturalWidth, height: el.naturalHeight }));
    // The bytes the <img> was served: a PNG whose header gives the size the browser decoded.
    const head = await img.evaluate(async (el) => {
      const response = await fetch(el.src);
      return { status: response.status, type: response.headers.get("content-type"),
               bytes: Array.from(new Uint8Array(await response.arrayBuffer()).slice(0, 24)) };
    });
    expect(head.status === 200 && head.type === "image/png", `the image is served as ${head.status} ${head.type}`);
    expect(head.bytes.slice(0, 8).join(",") === "137,80,78,71,13,10,26,10", "the output starts with the PNG signature");
    const be32 = (at) => ((head.bytes[at] << 24) | (head.bytes[at + 1] << 16) | (head.bytes[at + 2] << 8) | head.bytes[at + 3]) >>> 0;
    expect(be32(16) === shown.width && be32(20) === shown.height && shown.width >= 64,
      `IHDR ${be32(16)}x${be32(20)}, decoded ${shown.width}x${shown.height}`);
    // `saved` is JSON naming the files save_outputs wrote: shown as those files (the PNG as a
    // thumbnail, the text as a download), served as the run's files, never as server paths.
    const saved = tid("output-files-saved");
    await page.waitForFunction((s) => document.querySelector(s)?.naturalWidth > 0, `${saved} .output-file-thumb img`);
    const links = await page.$$eval(`${saved} a.output-file-link`, (els) => els.map((a) => a.getAttribute("href")));
    expect(links.length === 2 && links.every((href) => href.startsWith(`/api/runs/${run.id}/files/`)),
      `the saved output's files are the run's: ${links}`);
    // ... and not as its raw JSON: the folder it names reads as a name in the user's own files.
    expect((await page.locator(`${tid("output-saved")} .output-json`).count()) === 0, "no raw JSON for `saved`");
    const folder = (await page.textContent(`${tid("saved-files-saved")} .saved-leaf dd`)).trim();
    expect(folder.endsWith(run.id) && !folder.startsWith("/"), `the folder is named in the user's files: ${folder}`);
    // The VAE (tiny-vae) and the diffusion role's seeded head have random weights: the run says so on
    // their roles and nodes, as the editor does; the rewrite ran the real smollm2-135m and says nothing.
    await waitText(tid("run-random-weights"), "tiny-vae");
    expect((await page.textContent(tid("random-role-vae"))).includes("decode"), "the note names the vae's node");
    expect((await page.textContent(tid("random-role-diffusion"))).includes("denoise"), "and the diffusion's");
    expect((await page.locator(tid("node-random-decode")).count()) === 1, "the decode node is marked");
    expect((await page.locator(tid("node-random-denoise")).count()) === 1, "the denoise node is marked");
    expect((await page.locator(tid("node-random-rewrite")).count()) === 0, "the real-weights rewrite is not");
    await shot("run-image-generation-done");
  });

  await step("open the cluster view and see the KV hit rate rise after a second run of the same prompt", async () => {
    // The deployment's llm worker has served the first run's prompt once; the same request again
    // finds the prompt's pages in its device tier. Each reading waits for a heartbeat that
    // postdates the run, so it carries the worker's counters after that run.
    const first = await hitRateAfter(await finishedAt());
    await runOnDeployment(workflowIds.imageGeneration);
    await hitRateAfter(await finishedAt());
    // The chart's rows follow the heartbeats the table shows: wait for the one after the run to land.
    const rose = await page.waitForFunction(
      ([s, before]) => Number(document.querySelector(s)?.dataset.value ?? "") > before,
      [tid("chart-hit-rate-device"), first], { timeout: 30_000 },
    ).then(() => true, () => false);
    const second = Number(await page.getAttribute(tid("chart-hit-rate-device"), "data-value"));
    expect(rose, `the device hit rate went from ${first} to ${second}`);
    await waitText('[data-testid="worker-row"][data-role="llm"]', "smollm2-135m"); // the role's model
    // ... and the deployment it serves, by name, linking to the deployment's view.
    await waitText('[data-testid="worker-row"][data-role="llm"] [data-testid="worker-deployment"]', "image_generation");
    await shot("cluster-kv-hit-rate-rise");
    await openWorkflow("image_generation");
    await page.click(tid("deploy"));
    await page.click(tid("deployment-stop"));
    await page.waitForSelector('[data-testid="deployment-row"][data-status="stopped"]', { timeout: 60_000 });
    await page.keyboard.press("Escape");
  });

  await step("sign out", async () => {
    await page.click('button[aria-label="Sign out"]');
    await page.waitForURL(/\/login/);
  });

  expectQuietConsole();
} finally {
  await finish();
}
