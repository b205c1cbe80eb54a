// Port labels on the editor's canvas read whole, in a real Chromium against a live studio.
//
//   STUDIO_URL=... STUDIO_USER=... STUDIO_PASSWORD=... E2E_ARTIFACTS=... E2E_EXAMPLES=chat,diamond,...
//   node e2e/ports.e2e.mjs
//
// tests/e2e/test_ux_e2e.py runs it against the studio of tests/e2e/conftest.py:
//  - signed out, the login page opens without a console error (not even a failed request);
//  - every example workflow (E2E_EXAMPLES: the user's workflows of those names) opened in the editor: no port name cut short (its text wider than its
//    box), no port label past its node's edge, no input label running into the output beside it;
//  - a node of every kind in the palette (the built-in kinds and any plug-in's) added to a new
//    workflow: the same.
// Every step leaves a screenshot in E2E_ARTIFACTS; a failing one FAILED-<step>.png, and exits 1.

import { expect, logIn, openBrowser, tid, validityShows } from "./harness.mjs";

const BASE = process.env.STUDIO_URL ?? "http://127.0.0.1:8000";
const USER = process.env.STUDIO_USER ?? "demo";
const PASSWORD = process.env.STUDIO_PASSWORD ?? "demo";
const EXAMPLES = (process.env.E2E_EXAMPLES ?? "").split(",").filter(Boolean);

const { page, shot, step, expectQuietConsole, finish } = await openBrowser("ports", { wait: 30_000 });

/**
 * What is wrong with the port labels on the canvas, one line each ("<node>: <label> ..."): a port
 * name whose text is wider than its box (an ellipsis shows), a label outside its node, an input's
 * label overlapping the output's on the same row. Measured in the canvas's own pixels.
 */
async function unreadablePorts() {
  return page.$$eval(".spec-node .port-row", (rows) => {
    const problems = [];
    for (const row of rows) {
      const node = row.closest(".spec-node");
      const where = node.dataset.testid.replace(/^node-/, "");
      const box = node.getBoundingClientRect();
      const labels = [...row.querySelectorAll(".port")];
      for (const label of labels) {
        const name = label.querySelector(".port-name");
        if (name.scrollWidth > name.clientWidth) {
          problems.push(`${where}: ${label.title} is cut short (${name.scrollWidth} > ${name.clientWidth} px)`);
        }
        const r = label.getBoundingClientRect();
        if (r.left < box.left || r.right > box.right) problems.push(`${where}: ${label.title} runs past the node`);
      }
      const [inLabel, outLabel] = [row.querySelector(".port-in"), row.querySelector(".port-out")];
      if (inLabel && outLabel && inLabel.getBoundingClientRect().right > outLabel.getBoundingClientRect().left) {
        problems.push(`${where}: ${inLabel.title} overlaps ${outLabel.title}`);
      }
    }
    return problems;
  });
}

try {
  await step("the login page opens without a console error", async () => {
    await page.goto(`${BASE}/workflows`); // signed out: the app sends the visitor to its login page
    await page.waitForURL(/\/login/);
    await page.waitForSelector('input[name="username"]');
    // Not even a failed request: it used to probe /api/tokens/ for a 401 to tell it was signed out.
    expectQuietConsole(/(?!)/);
  });

  await step("login", () => logIn(page, BASE, USER, PASSWORD));

  await step("every example workflow's port labels read whole", async () => {
    expect(EXAMPLES.includes("chat") && EXAMPLES.includes("omni_dialogue"), `E2E_EXAMPLES names the examples: ${EXAMPLES}`);
    const problems = [];
    for (const name of EXAMPLES) {
      await page.goto(`${BASE}/workflows`);
      await page.locator(`${tid(`workflow-row-${name}`)} .row-title`).click();
      await page.waitForSelector(tid("editor"));
      await page.waitForSelector(".spec-node .port-row");
      problems.push(...(await unreadablePorts()).map((p) => `${name}/${p}`));
      if (name === "chat") await shot("chat-llm-ports");
    }
    expect(problems.length === 0, `port labels that do not read whole:\n${problems.join("\n")}`);
  });

  await step("a node of every kind in the palette: its port labels read whole", async () => {
    await page.goto(`${BASE}/workflows`);
    await page.click(tid("new-workflow"));
    await page.fill(`${tid("create-dialog")} input[name="name"]`, `e2e-every-kind-${Date.now()}`);
    await page.click(tid("create-submit"));
    await page.waitForSelector(tid("palette-llm"));
    const kinds = await page.$$eval('[data-testid^="palette-"].palette-item', (els) =>
      els.map((e) => e.dataset.testid.replace(/^palette-/, "")));
    for (const kind of ["input", "output", "python", "llm", "llm.prefill", "llm.decode", "diffusion", "vae_decode"]) {
      expect(kinds.includes(kind), `the palette offers ${kind}: ${kinds}`);
    }
    for (const kind of kinds) await page.click(tid(`palette-${kind}`));
    await page.waitForFunction((n) => document.querySelectorAll(".react-flow__node").length === n, kinds.length);
    await validityShows(page, "issue"); // unconnected, model-less: the nodes show their issues too
    const problems = await unreadablePorts();
    // Added at one spot, they overlap: spread them for the picture, once the view's re-fit has moved and settled.
    const transform = () => page.$eval(".react-flow__viewport", (el) => getComputedStyle(el).transform);
    const before = await transform();
    await page.click('button:has-text("Auto-layout")');
    await page.waitForFunction((was) => {
      const now = getComputedStyle(document.querySelector(".react-flow__viewport")).transform;
      const settled = now !== was && now === window.__lastTransform;
      window.__lastTransform = now;
      return settled;
    }, before, { polling: 100 });
    await shot("every-kind");
    expect(problems.length === 0, `port labels that do not read whole:\n${problems.join("\n")}`);
  });

  expectQuietConsole();
} finally {
  await finish();
}
