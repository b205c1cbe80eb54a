// What a newcomer meets first, in a real Chromium driven by Playwright, against a live studio.
//
//   STUDIO_URL=... STUDIO_USER=... STUDIO_PASSWORD=... E2E_ARTIFACTS=... node e2e/firstlook.e2e.mjs
//
// tests/e2e/test_ux_e2e.py runs it against the studio of tests/e2e/conftest.py:
//  - the workflows list's Updated column: a date and how long ago, the full timestamp on hover;
//  - the editor of image_generation opened, timed from the click to its nodes on the canvas (the
//    time is printed with /api/models/'s: the first editor a studio opened once waited seconds for
//    that answer, see tests/unit/client/test_light_imports.py);
//  - its model picker: smollm2-135m reads real weights for the llm role and random weights (for
//    testing) for the diffusion role, whose head is seeded;
//  - a new llm node with nothing wired into it: flagged on its node and its prompt port before any
//    save, and no longer once an input feeds its prompt; an input then retyped to what the port it
//    feeds does not take (json into llm.tokens) flagged on the edge, both nodes and the inspector;
//  - a workflow's version 1 in the history, compared with nothing: its fields read as added, none
//    as changed, and its text diff adds every line.
// Every step leaves a screenshot in E2E_ARTIFACTS; a failing one FAILED-<step>.png, and exits 1.

import { dragPorts, expect, logIn, openBrowser, tid, validityShows, viewportSettled } from "./harness.mjs";

const BASE = process.env.STUDIO_URL ?? "http://127.0.0.1:8000";
const USER = process.env.STUDIO_USER ?? "demo";
const PASSWORD = process.env.STUDIO_PASSWORD ?? "demo";

const { page, shot, step, waitText, expectQuietConsole, finish } = await openBrowser("firstlook", { wait: 30_000 });
const row = (name) => tid(`workflow-row-${name}`);
async function openWorkflow(name) {
  await page.goto(`${BASE}/workflows`);
  await page.locator(`${row(name)} .row-title`).click();
  await page.waitForSelector(tid("editor"));
}
/** Issue codes the studio reports for the editor's document, as the Issues tab lists them. */
async function issueCodes() {
  await page.click(tid("tab-issues"));
  return page.$$eval(`${tid("issues-panel")} .issue-item .code`, (els) => els.map((e) => e.textContent));
}

try {
  await step("login", () => logIn(page, BASE, USER, PASSWORD));

  await step("the workflows list dates each update and says how long ago", async () => {
    await page.waitForSelector(row("image_generation"));
    const updated = page.locator(`${row("image_generation")} time`);
    const [text, title, when] = await Promise.all([updated.textContent(), updated.getAttribute("title"),
                                                   updated.getAttribute("datetime")]);
    expect(/^[A-Z][a-z]{2} \d{1,2}(, \d{4})?, \d{2}:\d{2}( [AP]M)? · .+/.test(text), `the Updated cell reads ${text}`);
    expect(/ ago$|^.* · just now$/.test(text), `it says how long ago: ${text}`);
    const year = String(new Date(when).getFullYear());
    expect(title.includes(year) && /\d{1,2}:\d{2}:\d{2}/.test(title), `its tooltip is the full timestamp: ${title}`);
    await updated.hover();
    await shot("workflows-dates");
  });

  await step("the image_generation editor opens with its graph drawn", async () => {
    await page.goto(`${BASE}/workflows`);
    await page.waitForSelector(row("image_generation"));
    let models = null;
    const t0 = Date.now();
    const seen = (r) => {
      if (r.url().includes("/api/models/")) models = Date.now() - t0;
    };
    page.on("requestfinished", seen);
    await page.locator(`${row("image_generation")} .row-title`).click();
    await page.waitForSelector(".react-flow__node");
    const drawn = Date.now() - t0;
    page.off("requestfinished", seen);
    console.log(`     image_generation editor: nodes drawn ${drawn} ms after the click (/api/models/ ${models} ms)`);
    await validityShows(page, "Valid");
    await shot("editor-image_generation");
  });

  await step("the model picker says smollm2-135m is real for the llm role and random for the diffusion one", async () => {
    await page.click(tid("tab-roles"));
    const option = (role) => page.$eval(`${tid(`role-${role}-model`)} option[value="smollm2-135m"]`,
      (o) => ({ text: o.textContent, group: o.parentElement.getAttribute("label") }));
    const llm = await option("llm");
    const diffusion = await option("diffusion");
    expect(!llm.text.includes("random") && llm.group === "Built-in, real weights", `llm role: ${JSON.stringify(llm)}`);
    expect(diffusion.text.includes("random weights (for testing)") && diffusion.group.includes("random weights"),
      `diffusion role: ${JSON.stringify(diffusion)}`);
    await waitText(tid("role-llm-model-label"), "real weights");
    await waitText(tid("role-diffusion-model-label"), "random weights (for testing)");
    await page.locator(tid("role-diffusion")).scrollIntoViewIfNeeded();
    await shot("editor-model-weights-per-role");
  });

  await step("an llm node with no prompt wired is flagged on its node before save", async () => {
    await page.goto(`${BASE}/workflows`);
    await page.click(tid("new-workflow"));
    await page.fill(`${tid("create-dialog")} input[name="name"]`, "e2e-no-prompt");
    await page.click(tid("create-submit"));
    await page.waitForSelector(tid("editor"));
    await page.dragAndDrop(tid("palette-llm"), tid("canvas"), { targetPosition: { x: 420, y: 160 } });
    await page.waitForSelector(tid("node-llm"));
    await page.waitForSelector(`${tid("node-llm")}.has-issues`);
    await waitText(`${tid("node-llm")} ${tid("node-issue")}`, "needs a prompt: connect its input port llm.prompt or llm.tokens");
    await page.waitForSelector(`${tid("node-llm")} .port-in.port-issue:has-text("prompt")`);
    expect((await issueCodes()).includes("missing_input"), "the Issues tab lists it");
    expect((await page.locator(tid("dirty")).count()) === 1, "nothing was saved");
    await shot("editor-llm-no-prompt");
  });

  await step("an input wired into its prompt clears it", async () => {
    await page.dragAndDrop(tid("palette-input"), tid("canvas"), { targetPosition: { x: 120, y: 120 } });
    await page.waitForSelector(tid("node-input"));
    await dragPorts(page, tid("port-input-out-value"), tid("port-llm-in-prompt"));
    await page.waitForSelector('[data-testid="rf__edge-input.value->llm.prompt"]');
    await page.waitForSelector(`${tid("node-llm")}:not(.has-issues)`);
    await validityShows(page, "issue"); // the llm role still has no model
    const codes = await issueCodes();
    expect(!codes.includes("missing_input") && codes.includes("model_missing"), `issues left: ${codes}`);
    await shot("editor-llm-prompt-wired");
  });

  await step("a new input asks for text, and its first edge gives it the type it feeds", async () => {
    const inspect = async (id) => {
      await viewportSettled(page);
      await page.locator(`${tid(`node-${id}`)} .spec-node-id`).click();
      await page.waitForSelector(tid("input-type"));
    };
    await inspect("input");
    expect((await page.inputValue(tid("input-type"))) === "text", "a new input is text, not any");
    // Its default is text as typed, not a JSON value to quote.
    await page.fill(`${tid("param-default")} input`, "a lighthouse");
    await page.press(`${tid("param-default")} input`, "Enter");
    expect((await page.locator(`${tid("param-default")} textarea`).count()) === 0, "no JSON box for a text default");
    await page.dragAndDrop(tid("palette-input"), tid("canvas"), { targetPosition: { x: 120, y: 320 } });
    await page.waitForSelector(tid("node-input_2"));
    await dragPorts(page, tid("port-input_2-out-value"), tid("port-llm-in-tokens"));
    await page.waitForSelector('[data-testid="rf__edge-input_2.value->llm.tokens"]');
    await waitText(`${tid("node-input_2")} .port-out`, "tokens");
    await inspect("input_2");
    expect((await page.inputValue(tid("input-type"))) === "tokens", "drawn to llm.tokens, it asks for tokens");
    await page.selectOption(tid("input-type"), "json"); // the picker: what the run form asks for
    await waitText(tid("input-type-hint"), "a JSON value");
    await waitText(`${tid("node-input_2")} .port-out`, "json");
    await shot("editor-input-type");
  });

  await step("retyped to what its port does not take, a connected input is flagged before save", async () => {
    const edge = '[data-testid="rf__edge-input_2.value->llm.tokens"]';
    // json feeding llm.tokens (set in the step before): the edge, the port it feeds and the input itself say so.
    await page.waitForSelector(`${edge}.edge-invalid`);
    await waitText(`${tid("node-llm")} ${tid("node-issue")}`, "input_2.value is json but input llm.tokens expects tokens");
    await page.waitForSelector(`${tid("node-input_2")}.has-issues`);
    await waitText(tid("input-type-issue"), "llm.tokens expects tokens");
    expect((await issueCodes()).includes("type_mismatch"), "the Issues tab lists a type_mismatch");
    expect((await page.locator(tid("dirty")).count()) === 1, "nothing was saved");
    await shot("editor-input-type-mismatch");
    await page.locator(`${tid("node-input_2")} .spec-node-id`).click();
    await page.selectOption(tid("input-type"), "any"); // any feeds every port
    await page.waitForSelector(`${edge}:not(.edge-invalid)`);
    await page.waitForSelector(`${tid("node-input_2")}:not(.has-issues)`);
    await validityShows(page, "issue");
    expect(!(await issueCodes()).includes("type_mismatch"), "any feeds llm.tokens");
    await page.locator(`${tid("node-input_2")} .spec-node-id`).click();
    await page.selectOption(tid("input-type"), "tokens");
    await validityShows(page, "issue");
    expect(!(await issueCodes()).includes("type_mismatch"), "tokens feeds llm.tokens");
  });

  await step("version 1 compared with nothing reads as added", async () => {
    page.once("dialog", (d) => d.accept()); // leaving the unsaved e2e-no-prompt behind
    await openWorkflow("loop");
    await page.click('button:has-text("History")');
    await page.waitForSelector(tid("version-1"));
    await waitText(tid("history-dialog"), "nothing (first version)");
    await page.waitForSelector(`${tid("version-diff")} [data-change]`);
    const fields = await page.$$eval(`${tid("version-diff")} [data-change]`,
      (els) => els.map((e) => [e.textContent.trim(), e.dataset.change]));
    expect(fields.length > 0 && fields.every(([, change]) => change === "added"), `workflow fields: ${JSON.stringify(fields)}`);
    expect(fields.some(([text]) => text === "+ name") && fields.some(([text]) => text === "+ version"),
      `name and version are added: ${JSON.stringify(fields)}`);
    expect((await page.locator(`${tid("version-diff")} .chip-changed`).count()) === 0, "nothing reads as changed");
    const removed = await page.$$eval(`${tid("version-diff")} .unified .u-del`, (els) => els.map((e) => e.textContent));
    expect(removed.length === 0, `the text diff removes nothing: ${removed}`);
    await shot("history-first-version");
  });

  await step("no unexpected console errors", () => expectQuietConsole());
} finally {
  await finish();
}
