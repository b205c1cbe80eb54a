// Endpoints, tokens and guided editing in a real Chromium, driven by Playwright, against a live studio.
//
//   STUDIO_URL=... STUDIO_USER=... STUDIO_PASSWORD=... E2E_ARTIFACTS=... E2E_PYTHON=<python with openai>
//   E2E_HELLO=<workflows/hello.py> node e2e/ux.e2e.mjs
//
// tests/e2e/test_ux_e2e.py runs it against the studio of tests/e2e/conftest.py:
//  - an API token made on the tokens page (reached from the user menu), its text copied;
//  - the chat workflow deployed from the editor: the dialog shows its name, its OpenAI endpoint and
//    its workers filling in live (the llm worker's own row starting, then ready); the deployment view's curl and Python (openai) snippets, run as
//    pasted (bash, and E2E_PYTHON) with that token, reach the deployment by its name;
//  - the token's last use on the tokens page; revoked, the same snippets are refused (401);
//  - a model-less llm role and an unregistered op flagged in the editor before any save, then
//    fixed with the model and op pickers (the op's signature fills the node's ports);
//  - the README's quick start (E2E_HELLO) imported as source and run;
//  - the largest example workflow opened in a 1024x768 window, readable.
// Every step leaves a screenshot in E2E_ARTIFACTS; a failing one FAILED-<step>.png, and exits 1.

import { spawnSync } from "node:child_process";
import { readFileSync, writeFileSync } from "node:fs";
import { join } from "node:path";

import { expect, logIn, openBrowser, tid, validityShows } from "./harness.mjs";

const BASE = process.env.STUDIO_URL ?? "http://127.0.0.1:8000";
const USER = process.env.STUDIO_USER ?? "demo";
const PASSWORD = process.env.STUDIO_PASSWORD ?? "demo";
const PYTHON = process.env.E2E_PYTHON ?? "python3";
const HELLO = process.env.E2E_HELLO ?? "../workflows/hello.py";
const WAIT = 30_000;

const { page, ART, shot, step, waitText, expectQuietConsole, finish } = await openBrowser(
  "ux", { wait: WAIT, clipboardOrigin: BASE });
const validity = (text) => validityShows(page, text);
async function openWorkflow(name) {
  await page.goto(`${BASE}/workflows`);
  await page.locator(`${tid(`workflow-row-${name}`)} .row-title`).click();
  await page.waitForSelector(tid("editor"));
}
/** Issue codes the studio reports for the editor's document, as the Issues tab lists them. */
async function issueCodes() {
  await page.click(tid("tab-issues"));
  return page.$$eval(`${tid("issues-panel")} .issue-item .code`, (els) => els.map((e) => e.textContent));
}
/** Run a snippet as a user pastes it: the curl one in bash, the Python one in E2E_PYTHON. */
function runSnippet(kind, text, token) {
  const [cmd, args] = kind === "curl" ? ["bash", ["-c", text]] : [PYTHON, ["-c", text]];
  const out = spawnSync(cmd, args, { env: { ...process.env, OMNIFLOW_TOKEN: token }, encoding: "utf8", timeout: 120_000 });
  return { status: out.status, stdout: out.stdout ?? "", stderr: out.stderr ?? "" };
}

let token = "";
let model = "";
let deploymentPath = "";

try {
  await step("login", () => logIn(page, BASE, USER, PASSWORD));

  await step("make an API token from the user menu and copy it", async () => {
    await page.click(tid("user-menu"));
    await page.waitForSelector(tid("menu-tokens"));
    await shot("user-menu");
    await page.click(tid("menu-tokens"));
    await page.waitForSelector(tid("tokens-page"));
    await page.fill(tid("token-name"), "e2e-openai");
    await page.click(tid("token-create"));
    await page.waitForSelector(tid("token-secret"));
    token = (await page.textContent(tid("token-secret"))).trim();
    expect(/^of_[A-Za-z0-9_-]{20,}$/.test(token), `the token reads ${token}`);
    await page.click(tid("token-copy"));
    await waitText(tid("token-copy"), "Copied");
    const copied = await page.evaluate(() => navigator.clipboard.readText());
    expect(copied === token, "the copy button put the token on the clipboard");
    const row = page.locator(`${tid("token-row")}[data-name="e2e-openai"]`);
    expect((await row.getAttribute("data-used")) === "no", "a new token has not been used");
    await shot("tokens-created");
    await page.reload();
    await page.waitForSelector(`${tid("token-row")}[data-name="e2e-openai"]`);
    expect((await page.locator(tid("token-secret")).count()) === 0, "the token's text is shown once only");
  });

  await step("deploy the chat workflow: its name, endpoint and workers, live", async () => {
    await openWorkflow("chat");
    await page.click(tid("deploy"));
    await page.waitForSelector(tid("deploy-submit"));
    expect((await page.getAttribute(tid("deploy-name"), "placeholder")) === "chat", "the name defaults to the workflow's");
    const hint = await page.textContent(tid("deploy-name-hint"));
    expect(hint.includes('model="chat"'), `the chat workflow's name is its OpenAI model: ${hint}`);
    // What the dialog shows as the deployment comes up, sampled in the page: the states seen per role,
    // and per real worker row (not a placeholder) the states it went through, in order.
    await page.evaluate(() => {
      window.__seen = new Set();
      window.__workers = {};
      window.__sampler = window.setInterval(() => {
        for (const row of document.querySelectorAll('[data-testid="deployment-worker"]')) {
          window.__seen.add(`${row.dataset.role}:${row.dataset.state}`);
          if (!row.dataset.worker) continue;
          const states = (window.__workers[`${row.dataset.role} ${row.dataset.worker}`] ??= []);
          if (states.at(-1) !== row.dataset.state) states.push(row.dataset.state);
        }
      }, 50);
    });
    await page.click(tid("deploy-submit"));
    await page.waitForSelector(tid("focused-deployment"));
    await page.waitForSelector(`${tid("deployment-worker")}[data-role="llm"][data-state="ready"]`, { timeout: 120_000 });
    await page.waitForSelector(`${tid("deployment-worker")}[data-role="py"][data-state="ready"]`, { timeout: 120_000 });
    await waitText(tid("workers-up"), "2 of 2 replicas up");
    const { seen, workers } = await page.evaluate(() => {
      window.clearInterval(window.__sampler);
      return { seen: [...window.__seen], workers: window.__workers };
    });
    writeFileSync(join(ART, "deploy-workers.json"), JSON.stringify({ seen, workers }, null, 2));
    expect(seen.includes("llm:starting") && seen.includes("llm:ready"), `the workers filled in live: ${seen}`);
    // One llm worker row, which went ready and never failed. Whether the dialog's poll caught that
    // very row starting (its process spawned, not yet registered) depends on how fast the worker
    // registers: a warm fork server can beat one poll. The role's starting state was seen above.
    const llm = Object.entries(workers).filter(([key]) => key.startsWith("llm "));
    expect(llm.length === 1, `one llm worker row: ${JSON.stringify(workers)}`);
    const [, states] = llm[0];
    expect(["starting", "ready"].includes(states[0]) && states.at(-1) === "ready" && !states.includes("failed"),
      `the llm worker's row went (starting, then) ready: ${JSON.stringify(workers)}`);
    model = (await page.textContent(tid("endpoint-model"))).trim();
    expect(model === "chat", `the deployment is named ${model}`);
    expect((await page.textContent(tid("endpoint-base-url"))).trim() === `${BASE}/v1`, "the base URL is this studio's /v1");
    const where = await page.textContent(`${tid("deployment-worker")}[data-role="llm"]`);
    expect(where.includes("#1"), `the llm worker's row names its replica: ${where}`);
    // The version runs now: the dialog does not invite a second deployment of it as if it were the first.
    await waitText(tid("deploy-submit"), "again");
    await waitText(tid("deploy-again-hint"), "deployed already as “chat”");
    expect((await page.getAttribute(tid("deploy-name"), "placeholder")) === "chat-2", "a second one would be chat-2");
    await shot("deploy-endpoint-workers");
    deploymentPath = await page.getAttribute(`${tid("deployment-row")}[data-name="${model}"] ${tid("deployment-open")}`, "href");
  });

  await step("the deployment view's snippets work as pasted, reaching the deployment by name", async () => {
    await page.goto(`${BASE}${deploymentPath}`);
    await page.waitForSelector(tid("deployment-page"));
    await waitText(tid("deployment-name"), model);
    await page.waitForSelector(`${tid("deployment-worker")}[data-role="llm"][data-state="ready"]`);
    const curl = await page.textContent(tid("snippet-curl"));
    await page.click(tid("snippet-curl-copy"));
    await waitText(tid("snippet-curl-copy"), "Copied");
    expect((await page.evaluate(() => navigator.clipboard.readText())) === curl, "the copy button copies the snippet");
    const byCurl = runSnippet("curl", curl, token);
    expect(byCurl.status === 0, `curl exited ${byCurl.status}: ${byCurl.stderr}`);
    expect(byCurl.stderr === "", `curl wrote to stderr (a progress meter, in a script): ${byCurl.stderr}`);
    const answer = JSON.parse(byCurl.stdout);
    expect(answer.object === "chat.completion" && answer.model === model, `curl's answer: ${byCurl.stdout}`);
    expect(typeof answer.choices[0].message.content === "string" && answer.choices[0].message.content.length > 0,
      `the reply: ${byCurl.stdout}`);
    await page.click(tid("snippet-tab-python"));
    const python = await page.textContent(tid("snippet-python"));
    const byPython = runSnippet("python", python, token);
    expect(byPython.status === 0, `the openai snippet exited ${byPython.status}: ${byPython.stderr}`);
    expect(byPython.stdout.trim().length > 0, "the openai client printed the reply");
    writeFileSync(join(ART, "snippets.txt"), `${curl}\n\n${byCurl.stdout}\n\n${python}\n\n${byPython.stdout}`);
    await shot("deployment-view");
  });

  await step("the token's last use shows; revoked, the same client is refused", async () => {
    await page.click(tid("user-menu"));
    await page.click(tid("menu-tokens"));
    const row = `${tid("token-row")}[data-name="e2e-openai"]`;
    await page.waitForSelector(`${row}[data-used="yes"]`);
    await shot("tokens-last-used");
    await page.click(`${row} ${tid("token-revoke")}`);
    await page.waitForSelector(tid("token-revoke-dialog"));
    await shot("token-revoke-confirm");
    await page.click(tid("token-revoke-confirm"));
    await page.waitForSelector(row, { state: "detached" });
    await page.goto(`${BASE}${deploymentPath}`);
    await page.waitForSelector(tid("snippet-python"), { state: "attached" });
    const python = await page.textContent(tid("snippet-python"));
    const refused = runSnippet("python", python, token);
    expect(refused.status !== 0 && /AuthenticationError|401/.test(refused.stderr), `after revoking: ${refused.stderr}`);
    const curl = runSnippet("curl", await page.textContent(tid("snippet-curl")), token);
    expect(curl.stdout.includes("invalid or revoked API token"), `curl after revoking: ${curl.stdout}`);
    await page.goto(`${BASE}/tokens`);
    await page.waitForSelector(tid("tokens-page"));
    await shot("tokens-revoked");
  });

  await step("a model-less llm role and an unregistered op are flagged before save", async () => {
    await page.goto(`${BASE}/workflows`);
    await page.click(tid("new-workflow"));
    await page.fill(`${tid("create-dialog")} input[name="name"]`, "e2e-checks");
    await page.click(tid("create-submit"));
    await page.waitForSelector(tid("editor"));
    const canvas = tid("canvas");
    await page.dragAndDrop(tid("palette-llm"), canvas, { targetPosition: { x: 180, y: 120 } });
    await page.waitForSelector(tid("node-llm"));
    await page.dragAndDrop(tid("palette-python"), canvas, { targetPosition: { x: 520, y: 320 } });
    await page.waitForSelector(tid("node-python"));
    await page.locator(`${tid("node-python")} .spec-node-id`).click();
    await page.selectOption(tid("node-op-select"), "__other__");
    await page.fill(tid("node-op-input"), "nothing.here");
    await page.press(tid("node-op-input"), "Enter");
    await waitText(tid("node-op-issue"), "not a registered op");
    await page.waitForSelector(`${tid("node-python")}.has-issues`);
    await shot("editor-op-unregistered");
    await waitText(`${tid("node-llm")} ${tid("node-role-issue")}`, "needs a model"); // on its node too
    await page.click(tid("tab-roles"));
    await waitText(tid("role-llm-model-issue"), "needs a model");
    await shot("editor-model-missing");
    const codes = await issueCodes();
    expect(codes.includes("model_missing") && codes.includes("op_unknown"), `issues: ${codes}`);
    expect((await page.locator(tid("dirty")).count()) === 1 && (await page.textContent(".editor-sub")).includes("unsaved"),
      "nothing was saved");
  });

  await step("the pickers fix them: a model with its weights' label, an op that fills the ports", async () => {
    await page.click(tid("tab-roles"));
    const options = await page.$$eval(`${tid("role-llm-model")} option`, (els) => els.map((e) => e.textContent));
    expect(options.some((o) => o.includes("tiny-llama") && o.includes("random weights (for testing)")), `models: ${options}`);
    expect(options.some((o) => o.trim() === "smollm2-135m"), `a real model is offered too: ${options}`);
    const checkpoints = await page.$$eval(`${tid("role-llm-model")} optgroup[label^="Checkpoints"] option`,
      (els) => els.map((e) => e.value));
    expect(checkpoints.join() === "org/tiny-ckpt", `the model directory's checkpoint, by its relative name: ${checkpoints}`);
    await page.selectOption(tid("role-llm-model"), "tiny-llama");
    await waitText(tid("role-llm-model-label"), "random weights (for testing)");
    await page.locator(`${tid("node-python")} .spec-node-id`).click();
    await page.selectOption(tid("node-op-select"), "hello.greet");
    await page.waitForSelector(tid("port-python-in-name"));
    await page.waitForSelector(tid("port-python-out-out"));
    expect((await page.locator(tid("port-python-in-x")).count()) === 0, "the default x port made way for the op's");
    await validity("issue");
    const codes = await issueCodes();
    expect(!codes.includes("model_missing") && !codes.includes("op_unknown"), `issues left: ${codes}`);
    await page.locator(`${tid("node-python")} .spec-node-id`).click();
    await shot("editor-op-picked");
  });

  await step("the README's quick start imports as source and runs", async () => {
    page.once("dialog", (d) => d.accept()); // leaving the unsaved e2e-checks behind
    await page.goto(`${BASE}/workflows`);
    // The demo's copy of the example goes first: the import makes its own (names are unique).
    await page.click(`${tid("workflow-row-hello")} button[aria-label="Delete hello"]`);
    await page.click(tid("confirm-delete"));
    await page.waitForSelector(tid("workflow-row-hello"), { state: "detached" });
    await page.click(tid("import-workflow"));
    await page.fill('textarea[aria-label="GraphSpec JSON or Python DSL source"]', readFileSync(HELLO, "utf8"));
    await shot("import-hello");
    await page.click(tid("import-submit"));
    await page.waitForSelector(tid("editor"));
    await waitText(tid("editor-name"), "hello");
    await validity("Valid");
    await page.waitForSelector(tid("node-greet"));
    await page.click(tid("run"));
    await page.waitForSelector(tid("run-form"));
    await page.fill(`${tid("input-name")} textarea`, "omni");
    await page.click(tid("submit-run"));
    await page.waitForSelector(tid("run-page"));
    await waitText(tid("run-status"), "done", 60_000);
    await waitText(tid("output-greeting"), "hello, omni");
    await shot("run-hello-done");
  });

  await step("the largest example opens readable in a 1024x768 window", async () => {
    await page.setViewportSize({ width: 1024, height: 768 });
    await openWorkflow("omni_dialogue");
    await page.waitForSelector(".react-flow__node");
    await page.waitForSelector(tid("palette-toggle")); // both side panels folded: the canvas has the room
    await page.waitForSelector(tid("sidepanel-toggle"));
    await page.waitForSelector(".react-flow__minimap");
    await page.waitForTimeout(300); // the first fit
    const zoom = await page.$eval(".react-flow__viewport", (el) => new DOMMatrix(getComputedStyle(el).transform).a);
    expect(zoom >= 0.75 - 1e-6, `zoom ${zoom}`);
    const canvas = await page.locator(tid("canvas")).boundingBox();
    expect(canvas.width >= 850, `the canvas is ${canvas.width} px wide of 1024`);
    const titles = await page.$$eval(".spec-node-id", (els) =>
      els.filter((e) => {
        const r = e.getBoundingClientRect();
        return r.right > 0 && r.left < window.innerWidth && r.bottom > 0 && r.top < window.innerHeight;
      }).map((e) => e.getBoundingClientRect().height));
    expect(titles.length >= 3 && Math.min(...titles) >= 11, `visible titles: ${titles}`);
    // Each input node whole inside the canvas (the view opens on them when the graph is too big to fit).
    const inputs = await page.$$eval(".spec-node", (els, c) =>
      els.filter((e) => e.querySelector(".spec-node-sub").textContent === "input").map((e) => {
        const r = e.getBoundingClientRect();
        return { id: e.dataset.testid, inView: r.left >= c.x && r.right <= c.x + c.width && r.top >= c.y && r.bottom <= c.y + c.height };
      }), canvas);
    expect(inputs.length === 3 && inputs.every((i) => i.inView), `the inputs are in view: ${JSON.stringify(inputs)}`);
    await shot("editor-large-1024");
    await page.locator(".react-flow__node .spec-node-id").first().click();
    await page.waitForSelector(tid("node-inspector"));
    const narrowed = await page.locator(tid("canvas")).boundingBox();
    expect(narrowed.width >= 560, `with the inspector open the canvas keeps ${narrowed.width} px`);
    await shot("editor-large-1024-inspect");
    await page.click(tid("sidepanel-fold"));
    await page.waitForSelector(tid("sidepanel-toggle"));
    await page.setViewportSize({ width: 1440, height: 960 });
  });

  await step("stop the deployment from its view, opened by its row in the list", async () => {
    await page.goto(`${BASE}/deployments`);
    await page.click(`${tid("deployment-list-row")}:has-text("${model}") td:nth-child(3)`); // its status, not a link
    await page.waitForSelector(tid("deployment-page"));
    expect(page.url() === `${BASE}${deploymentPath}`, `the row opened ${page.url()}`);
    await page.click(tid("deployment-stop"));
    await waitText(tid("deployment-page"), "stopped", 60_000);
    await shot("deployment-stopped");
  });

  expectQuietConsole();
} finally {
  await finish();
}
