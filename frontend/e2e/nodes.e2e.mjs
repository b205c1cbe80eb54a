// The distributed studio's node views in a real Chromium, driven by Playwright: the deploy
// dialog shows where each replica would go (and on which GPUs) before the user confirms, the deployment made from
// it runs on those nodes, the cluster page groups the workers by node, and a second deployment
// that fits nowhere is shown refused with its reason.
//
//   STUDIO_URL=... STUDIO_USER=... STUDIO_PASSWORD=... WORKFLOW_ID=<uuid> E2E_ARTIFACTS=...
//   EXPECT='{"<node>": ["role", ...], ...}' EXPECT_GPUS='{"<node>": {"<role>": "#1 GPU 0"}}' node e2e/nodes.e2e.mjs
//
// tests/studio/test_multinode.py starts the studio and its nodes (network namespaces) and runs
// this script. A failing step leaves FAILED-<step>.png in E2E_ARTIFACTS and exits 1.

import { join } from "node:path";

import { expect, openBrowser, tid } from "./harness.mjs";

const BASE = process.env.STUDIO_URL;
const WORKFLOW = process.env.WORKFLOW_ID;
const EXPECT = JSON.parse(process.env.EXPECT);
// Node -> role -> what the preview says of its replicas' GPUs (nodes and roles in name order).
const EXPECT_GPUS = JSON.parse(process.env.EXPECT_GPUS ?? "{}");
// Generous: on two cores shared with other test runs, the editor's first render alone took
// over 20 s at a load of 18.
const WAIT = 60_000;

const { page, ART, step, close } = await openBrowser(
  "nodes", { viewport: { width: 1500, height: 1000 }, wait: WAIT });
/** Node -> sorted roles, as a table or list on the page shows them. */
async function rolesByNode(rowSelector, nodeAttr, roleSelector) {
  return page.evaluate(([rows, attr, roles]) => {
    const out = {};
    for (const row of document.querySelectorAll(rows)) {
      const found = [...row.querySelectorAll(roles)].map((el) => el.dataset.role).sort();
      if (found.length) out[row.dataset[attr]] = found;
    }
    return out;
  }, [rowSelector, nodeAttr, roleSelector]);
}
const same = (a, b) => JSON.stringify(a) === JSON.stringify(b);
/** The editor of the workflow, once its document is checked (the page has settled). */
async function openEditor() {
  await page.goto(`${BASE}/workflows/${WORKFLOW}`);
  await page.waitForSelector(tid("editor"));
  await page.waitForSelector(`${tid("validity")}[data-checking="false"]`);
}

try {
  await step("login", async () => {
    await page.goto(`${BASE}/workflows`);
    await page.waitForURL(/\/login/);
    await page.fill('input[name="username"]', process.env.STUDIO_USER);
    await page.fill('input[name="password"]', process.env.STUDIO_PASSWORD);
    await page.click('button[type="submit"]');
    await page.waitForURL(/\/workflows$/);
  });

  await step("the deploy dialog shows the planned placement, then deploys", async () => {
    await openEditor();
    await page.click(tid("deploy"));
    await page.waitForSelector(tid("placement-table"));
    const planned = await rolesByNode(tid("placement-node"), "node", "[data-role]");
    expect(same(planned, EXPECT), `planned ${JSON.stringify(planned)}, expected ${JSON.stringify(EXPECT)}`);
    const gpus = await page.evaluate(() => {
      const out = {};
      for (const row of document.querySelectorAll('[data-testid="placement-node"]')) {
        for (const el of row.querySelectorAll('[data-testid="placement-gpus"]')) {
          out[row.dataset.node] = { ...(out[row.dataset.node] ?? {}), [el.dataset.for]: el.textContent.trim() };
        }
      }
      return out;
    });
    expect(same(gpus, EXPECT_GPUS), `GPUs ${JSON.stringify(gpus)}, expected ${JSON.stringify(EXPECT_GPUS)}`);
    await page.screenshot({ path: join(ART, "01-deploy-placement.png"), animations: "disabled" });
    await page.click(tid("deploy-submit"));
    await page.waitForSelector('[data-testid="deployment-row"][data-status="running"]', { timeout: 300_000 });
  });

  await step("the cluster page groups the workers by node", async () => {
    await page.goto(`${BASE}/cluster`);
    await page.waitForFunction(
      ([sel, want]) => {
        const out = {};
        for (const card of document.querySelectorAll(sel)) {
          const roles = [...card.querySelectorAll('[data-testid="node-worker"]')].map((el) => el.dataset.role).sort();
          if (roles.length) out[card.dataset.node] = roles;
        }
        return JSON.stringify(out) === want;
      },
      [tid("node-card"), JSON.stringify(EXPECT)],
      { timeout: WAIT },
    );
    const live = await page.$$eval('[data-testid="node-card"][data-status="live"]', (cards) => cards.length);
    expect(live === Object.keys(EXPECT).length, `${live} live node cards`);
    await page.screenshot({ path: join(ART, "02-cluster-by-node.png"), animations: "disabled", fullPage: true });
  });

  await step("a second deployment that fits nowhere is shown refused with its reason", async () => {
    await openEditor();
    await page.click(tid("deploy"));
    await page.waitForSelector(tid("placement-refused"));
    const reasons = await page.$$eval(tid("placement-refusal"), (items) => items.map((li) => li.textContent));
    expect(reasons.some((r) => r.includes("role 'llm'") && r.includes("needs 1 GPU, 0 free")),
      `refusals: ${JSON.stringify(reasons)}`);
    await page.screenshot({ path: join(ART, "03-deploy-refused.png"), animations: "disabled" });
  });
} finally {
  await close();
}
