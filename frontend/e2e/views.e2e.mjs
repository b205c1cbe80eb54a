// Views that stay readable and usable, in a real Chromium driven by Playwright, against a live studio.
//
//   STUDIO_URL=... STUDIO_USER=... STUDIO_PASSWORD=... E2E_ARTIFACTS=... node e2e/views.e2e.mjs
//
// tests/e2e/test_ux_e2e.py runs it against the studio of tests/e2e/conftest.py:
//  - a run of image_generation and of the largest example (omni_dialogue), at 1440x960 and at
//    1024x768, opens its graph as the editor does: at a zoom where node titles are legible, the
//    inputs in view, a minimap for the rest (the run view used to fit the whole graph, ~0.5);
//  - fit-to-view, in the editor and in the run view (on opening and with the fit-view control),
//    leaves no node under the minimap in the canvas's bottom-right corner or under the zoom and
//    fit buttons in its bottom-left corner; image_generation at 1440x900 on the New run form and the
//    run page, not even a node the canvas's edge cuts (its denoise node sat under the map there);
//  - the run page's node table: each node's id, its "random weights" pill and its time on one line;
//  - a notice (toast) shown while the wide deploy dialog is open covers none of its footer's
//    buttons, which take a click;
//  - worker ids (the deployment's workers, the cluster page) read start…end on one line, the whole
//    id in their tooltip, and copy whole (with their button, or selected as text);
//  - the runs and deployments lists fit their card at 1024 and 1440 px wide, each row on one line
//    (a long deployment name cut short, whole in its title);
//  - a newcomer's first workflow at 1024x768: the empty canvas opens with its palette (it says to
//    drag from it), the bar's name and validity keep one line, a python node connected before its
//    op is chosen keeps its edges when the op is picked, and page buttons stay on one row;
//  - a saved version with issues (a python node without its op) cannot be run: the Run button is
//    disabled and says which version has how many issues; editing that incomplete graph leaves no
//    error in the console (the editor asks /api/validate/ for its report: issues as data, not a 400).
// Every step leaves a screenshot in E2E_ARTIFACTS; a failing one FAILED-<step>.png, and exits 1.

import { dragPorts, expect, logIn, openBrowser, settledBox, tid, validityShows, viewportSettled } from "./harness.mjs";

const BASE = process.env.STUDIO_URL ?? "http://127.0.0.1:8000";
const USER = process.env.STUDIO_USER ?? "demo";
const PASSWORD = process.env.STUDIO_PASSWORD ?? "demo";
const LEGIBLE_ZOOM = 0.75; // graph/viewport.ts
const LEGIBLE_TITLE_PX = 11;
const LONG_DEPLOYMENT = "diamond-deployed-under-a-name-long-enough-to-be-cut-short-in-the-list";

const { page, shot, step, waitText, consoleErrors, expectQuietConsole, finish } = await openBrowser("views", {
  wait: 30_000, clipboardOrigin: BASE });

async function openWorkflow(name) {
  await page.goto(`${BASE}/workflows`);
  await page.locator(`${tid(`workflow-row-${name}`)} .row-title`).click();
  await page.waitForSelector(tid("editor"));
}

/** The zoom of the graph inside `container`, once its first fit has settled (two frames alike). */
async function settledZoom(container) {
  const read = () => page.$eval(`${container} .react-flow__viewport`, (el) => new DOMMatrix(getComputedStyle(el).transform).a);
  await page.waitForSelector(`${container} .react-flow__node`);
  let last = -1;
  for (;;) {
    await page.waitForTimeout(100); // a frame or more between readings: the fit lands once measured
    const zoom = await read();
    if (zoom === last) return zoom;
    last = zoom;
  }
}

/** What in `container`'s graph is not readable: zoom, titles in view and their heights, inputs out of view. */
async function readability(container) {
  const zoom = await settledZoom(container);
  const seen = await page.$eval(container, (root) => {
    const c = root.getBoundingClientRect();
    const inside = (r) => r.left >= c.left && r.right <= c.right && r.top >= c.top && r.bottom <= c.bottom;
    const titles = [...root.querySelectorAll(".spec-node-id")].map((e) => e.getBoundingClientRect()).filter(inside);
    const inputs = [...root.querySelectorAll(".spec-node")].filter((e) => e.querySelector(".spec-node-sub").textContent === "input");
    return {
      titleHeights: titles.map((r) => r.height),
      inputsOut: inputs.filter((e) => !inside(e.getBoundingClientRect())).map((e) => e.dataset.testid),
      nodes: root.querySelectorAll(".spec-node").length,
      minimap: root.querySelector(".react-flow__minimap") !== null,
    };
  });
  return { zoom, ...seen, covered: await nodesCovered(container) };
}

function expectReadable(where, r) {
  expect(r.zoom >= LEGIBLE_ZOOM - 1e-6, `${where}: zoom ${r.zoom} < ${LEGIBLE_ZOOM}`);
  expect(r.titleHeights.length >= 3 && Math.min(...r.titleHeights) >= LEGIBLE_TITLE_PX,
         `${where}: node titles in view ${JSON.stringify(r.titleHeights)}`);
  expect(r.inputsOut.length === 0, `${where}: inputs out of view ${r.inputsOut}`);
  expect(r.titleHeights.length === r.nodes || r.minimap, `${where}: part of the graph shown and no minimap`);
  expect(r.covered.length === 0, `${where}: fitted with nodes under the minimap or the zoom buttons: ${r.covered}`);
}

/** The nodes shown whole in `container` that the minimap, its Hide button or the zoom and fit buttons
 * cover, each as "<node> under <what>" (one the canvas's edge cuts is part of the rest of the graph,
 * which the map stands for). */
function nodesCovered(container, { partial = false } = {}) {
  return page.$eval(container, (root, partial) => {
    const c = root.getBoundingClientRect();
    const covers = [".react-flow__minimap", ".minimap-toggle", ".react-flow__controls"]
      .map((s) => [s, root.querySelector(s)]).filter(([, e]) => e).map(([s, e]) => [s, e.getBoundingClientRect()]);
    return [...root.querySelectorAll(".spec-node")].flatMap((n) => {
      const whole = n.getBoundingClientRect();
      const shown = whole.left >= c.left && whole.right <= c.right && whole.top >= c.top && whole.bottom <= c.bottom;
      // `partial`: a node the canvas's edge cuts counts too, by the part of it in view.
      const r = { left: Math.max(whole.left, c.left), right: Math.min(whole.right, c.right),
                  top: Math.max(whole.top, c.top), bottom: Math.min(whole.bottom, c.bottom) };
      if (!shown && !(partial && r.left < r.right && r.top < r.bottom)) return [];
      return covers.filter(([, m]) => r.right > m.left && r.left < m.right && r.bottom > m.top && r.top < m.bottom)
        .map(([s]) => `${n.dataset.testid} under ${s}`);
    });
  }, partial);
}

/** Each node's height in `container`, in layout pixels (the zoom left out), by its test id. */
const nodeHeights = (container) => page.$eval(container, (root) =>
  Object.fromEntries([...root.querySelectorAll(".spec-node")].map((n) => [n.dataset.testid, n.offsetHeight])));

const edgeIds = () => page.$$eval(".react-flow__edge", (els) => els.map((e) => e.dataset.testid).sort());

/** A worker id as WorkerId shows it: whole up to 21 characters, else its first 10 and last 10 around "…". */
const shortId = (id) => (id.length <= 21 ? id : `${id.slice(0, 10)}…${id.slice(-10)}`);

/** Every worker id in `scope`: shown start…end on one line, the whole id in its tooltip; `rows` of them at least. */
async function expectWorkerIds(scope, rows) {
  const ids = await page.$$eval(`${scope} ${tid("worker-id")}`, (els) => els.map((el) => ({
    id: el.dataset.workerId, title: el.title, text: el.querySelector(".worker-id-text").textContent,
    height: el.getBoundingClientRect().height,
  })));
  expect(ids.length >= rows, `${scope}: ${ids.length} worker ids shown, not ${rows}`);
  for (const { id, title, text, height } of ids) {
    expect(title === id && text === shortId(id) && height <= 24, `${scope}: worker id ${id} shows ${JSON.stringify({ text, title, height })}`);
  }
  return ids.map((i) => i.id);
}

/** Each row of the run page's node table on one line: a node id and its "random weights" pill side
 * by side, the pill's words on one line, nothing wrapped under the id. */
async function expectNodeTableOneLine(where) {
  const rows = await page.$$eval(`${tid("node-table")} tbody tr`, (trs) => trs.map((tr) => {
    const id = tr.querySelector(".node-id").getBoundingClientRect();
    const pill = tr.querySelector(".pill.random-weights")?.getBoundingClientRect();
    const time = tr.querySelector('[data-testid^="node-time-"]');
    const line = (el) => { const r = document.createRange(); r.selectNodeContents(el); return r.getClientRects().length; };
    return { node: tr.dataset.testid, id: [id.top, id.bottom, id.height], timeLines: line(time),
             pill: pill && [pill.top, pill.bottom, pill.height, pill.left, id.right] };
  }));
  expect(rows.some((r) => r.pill), `${where}: some node shows the random weights pill`);
  for (const { node, id, pill, timeLines } of rows) {
    expect(id[2] <= 24, `${where}: ${node}'s id wraps (${id[2]} px tall)`);
    expect(timeLines <= 1, `${where}: ${node}'s time wraps over ${timeLines} lines`);
    if (!pill) continue;
    const [top, bottom, height, left, idRight] = pill;
    expect(height <= 24 && top < id[1] && bottom > id[0] && left >= idRight,
      `${where}: ${node}'s pill is not on the id's line: ${JSON.stringify({ id, pill })}`);
  }
}

const overlaps = (a, b) => a.x < b.x + b.width && b.x < a.x + a.width && a.y < b.y + b.height && b.y < a.y + a.height;

try {
  await step("login", () => logIn(page, BASE, USER, PASSWORD));

  // 1440x900 too: image_generation (with its rewritten_prompt node) was cut off on the right there,
  // its denoise node under the minimap, on the New run form and the run page.
  for (const [width, height, names] of [[1440, 960, ["image_generation", "omni_dialogue"]],
                                        [1440, 900, ["image_generation"]],
                                        [1024, 768, ["image_generation", "omni_dialogue"]]]) {
    for (const name of names) {
      const size = height === 900 ? `${width}x${height}` : `${width}`;
      await step(`a run of ${name} opens readable at ${width}x${height}`, async () => {
        await page.setViewportSize({ width, height });
        await openWorkflow(name);
        await page.click(tid("run"));
        await page.waitForSelector(tid("run-form"));
        expectReadable(`${name}'s new run page`, await readability(".graph-card"));
        if (height === 900) {
          const partly = await nodesCovered(".graph-card", { partial: true });
          expect(partly.length === 0, `${name}'s new run page at ${width}x${height}: nodes partly under the map: ${partly}`);
        }
        await shot(`new-run-${name}-${size}`);
        await page.click(tid("submit-run"));
        await page.waitForSelector(tid("run-page"));
        const r = await readability(tid("run-graph"));
        expectReadable(`the run of ${name}`, r);
        if (height === 900) {
          const partly = await nodesCovered(tid("run-graph"), { partial: true });
          expect(partly.length === 0, `the run of ${name} at ${width}x${height}: nodes partly under the map: ${partly}`);
        }
        const sizesAtOpen = await nodeHeights(tid("run-graph"));
        await expectNodeTableOneLine(`the run of ${name} at ${width}x${height}`);
        await shot(`run-${name}-${size}`);
        // Zoomed in, then fitted again with the fit-view control: the opening view, clear of both corners.
        await page.click(`${tid("run-graph")} .react-flow__controls-zoomin`);
        await page.click(`${tid("run-graph")} .react-flow__controls-zoomin`);
        await settledZoom(tid("run-graph"));
        await page.click(`${tid("run-graph")} .react-flow__controls-fitview`);
        await viewportSettled(page);
        const fitted = await readability(tid("run-graph"));
        expectReadable(`the run of ${name} fitted`, fitted);
        expect(Math.abs(fitted.zoom - r.zoom) < 1e-3, `${name}'s run: fit-to-view gives the opening view: ${fitted.zoom}, ${r.zoom}`);
        console.log(`     ${name} ${width}x${height}: zoom ${r.zoom.toFixed(2)}, ${r.titleHeights.length} of ${r.nodes} titles in view`);
        // Its result is not what is tested: cancelled, it gives the cores back (unless it ends first:
        // the button goes with the run's end, so a click may find none).
        if (await page.locator(tid("cancel-run")).isVisible()) {
          await page.click(tid("cancel-run"), { timeout: 3000 }).catch(() => {});
        }
        await page.waitForFunction((s) => /done|failed|cancelled/i.test(document.querySelector(s)?.textContent ?? ""),
                                   tid("run-status"), { timeout: 60_000 });
        // A node keeps its size through the run (progress, where it ran, its error: one line each
        // time), so the fitted view stays clear of the corners while the run goes on.
        const sizesAtEnd = await nodeHeights(tid("run-graph"));
        expect(JSON.stringify(sizesAtEnd) === JSON.stringify(sizesAtOpen),
               `${name}'s nodes changed size during the run: ${JSON.stringify(sizesAtOpen)} -> ${JSON.stringify(sizesAtEnd)}`);
      });
    }
  }

  await step("fit-to-view in the editor leaves the minimap's and the zoom buttons' corners clear", async () => {
    for (const [width, height] of [[1024, 768], [1440, 900]]) {
      await page.setViewportSize({ width, height });
      // image_generation's diffusion and vae nodes sat under the map at 1024x768 after the fit.
      for (const name of ["image_generation", "omni_dialogue", "diamond"]) {  // the widest, the tallest, a small one (ports.e2e opens all ten)
        await openWorkflow(name);
        const canvas = tid("canvas");
        const opened = await readability(canvas);
        expectReadable(`${name} opened at ${width}x${height}`, opened);
        expect(opened.minimap, `${name}: the editor draws its minimap`);
        // Zoomed in, then fitted again with the fit-view control: the same view, clear of the map.
        await page.click(`${canvas} .react-flow__controls-zoomin`);
        await page.click(`${canvas} .react-flow__controls-zoomin`);
        await settledZoom(canvas);
        await page.click(`${canvas} .react-flow__controls-fitview`);
        await viewportSettled(page);
        const fitted = await readability(canvas);
        expectReadable(`${name} fitted at ${width}x${height}`, fitted);
        expect(Math.abs(fitted.zoom - opened.zoom) < 1e-3, `${name}: fit-to-view gives the opening view: ${fitted.zoom}, ${opened.zoom}`);
        if (name === "image_generation") await shot(`editor-fit-beside-map-${width}`);
      }
    }
  });

  await step("a toast leaves the wide deploy dialog's buttons clear and clickable", async () => {
    await page.setViewportSize({ width: 1024, height: 768 });
    await openWorkflow("diamond");
    await page.click(tid("deploy"));
    await page.waitForSelector(tid("deploy-submit"));
    // A long name, for the deployments list below to keep on one line.
    await page.fill(tid("deploy-name"), LONG_DEPLOYMENT);
    await page.click(tid("deploy-submit"));
    const toast = page.locator(tid("toast")).first();
    await toast.waitFor();
    // Measured where the toast stays: mid-way through its slide-in it sits a few px lower, over the footer.
    const box = await settledBox(toast);
    await shot("deploy-dialog-toast-1024");
    const buttons = await page.locator(`${tid("deploy-dialog")} .modal-foot button`).all();
    expect(buttons.length >= 2, `footer buttons: ${buttons.length}`);
    for (const button of buttons) {
      const b = await settledBox(button);
      expect(!overlaps(box, b), `the toast ${JSON.stringify(box)} covers the button ${await button.textContent()} ${JSON.stringify(b)}`);
    }
    // What the pointer reaches at each button's centre is the button itself.
    const hits = await page.$$eval(`${tid("deploy-dialog")} .modal-foot button`, (els) => els.map((el) => {
      const r = el.getBoundingClientRect();
      return el.contains(document.elementFromPoint(r.x + r.width / 2, r.y + r.height / 2));
    }));
    expect(hits.every(Boolean), `footer buttons under the pointer: ${hits}`);
    expect(await toast.isVisible(), "the toast is still showing when the buttons are checked");
    await page.locator(`${tid("deploy-dialog")} .modal-foot button`, { hasText: "Close" }).click({ timeout: 2000 });
    await page.waitForSelector(tid("deploy-dialog"), { state: "detached" });
  });

  await step("worker ids read start…end, whole in their tooltip, and copy whole", async () => {
    await page.goto(`${BASE}/deployments`);
    await page.locator(`${tid("deployment-list-row")}:has-text("diamond") .row-title`).first().click();
    await page.waitForSelector(tid("deployment-page"));
    // diamond's py role has two replicas: each row names its worker (`<workflow>-<deployment>-py-<replica>-<pid>`).
    const rows = `${tid("deployment-page")} ${tid("deployment-worker")}[data-worker]`;
    await page.waitForFunction((s) => document.querySelectorAll(s).length >= 2, rows);
    const headers = await page.$$eval(`${tid("deployment-workers")} th`, (ths) => ths.map((th) => th.textContent.trim()));
    expect(headers.includes("Worker"), `the deployment's workers table has a Worker column: ${headers}`);
    const shown = await expectWorkerIds(tid("deployment-workers"), 2);
    const listed = await page.$$eval(rows, (trs) => trs.map((tr) => tr.dataset.worker));
    expect(listed.every((id) => shown.includes(id)), `each worker row shows its own id: ${listed}, ${shown}`);
    expect(shown.some((id) => shortId(id) !== id), `a deployment's worker id is long enough to be shortened: ${shown}`);
    const first = page.locator(`${tid("deployment-workers")} ${tid("worker-id")}`).first();
    const whole = await first.getAttribute("data-worker-id");
    await first.hover();
    await first.locator(tid("worker-id-copy")).click();
    await page.waitForSelector(`${tid("worker-id-copy")}[data-state="copied"]`);
    const copied = await page.evaluate(() => navigator.clipboard.readText());
    expect(copied === whole, `the copy button copies the whole id: ${JSON.stringify(copied)}, not ${whole}`);
    // Selected and copied as text, the shortened id copies whole too.
    await page.evaluate(() => navigator.clipboard.writeText(""));
    await first.locator(".worker-id-text").selectText();
    await page.keyboard.press("Control+C");
    await page.waitForFunction((w) => navigator.clipboard.readText().then((t) => t === w), whole, { timeout: 5000 });
    await shot("deployment-worker-ids");
    await page.goto(`${BASE}/cluster`);
    await page.waitForSelector(tid("worker-row"));
    await expectWorkerIds(tid("workers-table"), 2);
    await expectWorkerIds(tid("worker-charts"), 0);
    await shot("cluster-worker-ids");
  });

  await step("stop the deployment the dialog made", async () => {
    await page.goto(`${BASE}/deployments`);
    await page.locator(`${tid("deployment-list-row")}:has-text("diamond") .row-title`).first().click();
    await page.waitForSelector(tid("deployment-page"));
    await page.click(tid("deployment-stop"));
    await waitText(tid("deployment-page"), "stopped", 60_000);
  });

  await step("the runs and deployments lists fit their card at 1024 and 1440 px, a row a line", async () => {
    for (const [width, height] of [[1024, 768], [1440, 900]]) {
      await page.setViewportSize({ width, height });
      for (const [path, card, row] of [["/runs", "runs-card", "run-row"], ["/deployments", "deployments-card", "deployment-list-row"]]) {
        await page.goto(`${BASE}${path}`);
        await page.waitForSelector(tid(row));
        const seen = await page.$eval(tid(card), (frame) => {
          const scroller = frame.querySelector(".scroll-table-body");
          return {
            overflow: scroller.scrollWidth - scroller.clientWidth,
            cue: frame.dataset.hiddenRight,
            // A one-line row is ~47 px; a name, version pill, status or time that wraps made it ~67.
            tall: [...frame.querySelectorAll("tbody tr")].map((tr) => tr.getBoundingClientRect().height).filter((h) => h > 56),
            // A cell's text on more than one line: taller than one line of its font.
            wrapped: [...frame.querySelectorAll("tbody td")].filter((td) => {
              const range = document.createRange();
              range.selectNodeContents(td);
              const lines = new Set([...range.getClientRects()].filter((r) => r.width > 0).map((r) => Math.round(r.bottom)));
              return lines.size > 1 && Math.max(...lines) - Math.min(...lines) > 8;
            }).map((td) => td.textContent.trim()),
          };
        });
        expect(seen.overflow <= 1 && seen.cue === "false", `${path} at ${width} px: the table runs past its card: ${JSON.stringify(seen)}`);
        expect(seen.tall.length === 0 && seen.wrapped.length === 0, `${path} at ${width} px: rows that wrap: ${JSON.stringify(seen)}`);
        await shot(`${path.slice(1)}-${width}`);
      }
      // The long name is cut short in its row (an ellipsis), whole in its title.
      const name = page.locator(`${tid("deployment-list-row")} .row-title[title="${LONG_DEPLOYMENT}"]`);
      const cut = await name.evaluate((el) => ({ text: el.textContent, scroll: el.scrollWidth, shown: el.clientWidth }));
      expect(cut.text === LONG_DEPLOYMENT && cut.scroll > cut.shown, `the long deployment name at ${width} px: ${JSON.stringify(cut)}`);
    }
    // A chat deployment's row says what a client names on /v1 (the deploy dialog made one of diamond: not chat).
    expect((await page.locator(tid("deployment-serves")).allTextContents()).every((t) => t === "runs" || t.startsWith("OpenAI model ")),
      "the Serves column reads 'runs' or 'OpenAI model <name>'");
  });

  await step("a newcomer draws a first workflow at 1024x768", async () => {
    await page.setViewportSize({ width: 1024, height: 768 });
    await page.goto(`${BASE}/workflows`);
    const [add, create] = [await page.locator(tid("new-workflow")).boundingBox(), await page.locator(".head-actions .btn").first().boundingBox()];
    expect(Math.abs(add.y - create.y) < 2, `the workflows page's buttons share a row: ${JSON.stringify([add, create])}`);
    await page.click(tid("new-workflow"));
    await page.fill(`${tid("create-dialog")} input[name="name"]`, `a-first-workflow-with-a-long-name-${Date.now()}`);
    await page.click(tid("create-submit"));
    await page.waitForSelector(tid("editor"));
    await page.waitForSelector(tid("palette-python")); // open, though the window is narrow: the canvas is empty
    const canvas = tid("canvas");
    await page.dragAndDrop(tid("palette-input"), canvas, { targetPosition: { x: 90, y: 110 } });
    await page.dragAndDrop(tid("palette-python"), canvas, { targetPosition: { x: 260, y: 300 } });
    await page.dragAndDrop(tid("palette-output"), canvas, { targetPosition: { x: 420, y: 130 } });
    await page.waitForSelector(tid("node-output"));
    await dragPorts(page, tid("port-input-out-value"), tid("port-python-in-x"));
    await page.waitForSelector('[data-testid="rf__edge-input.value->python.x"]');
    await dragPorts(page, tid("port-python-out-out"), tid("port-output-in-value"));
    await page.waitForSelector('[data-testid="rf__edge-python.out->output.value"]');
    await page.locator(`${tid("node-python")} .spec-node-id`).click();
    await page.selectOption(tid("node-op-select"), "hello.greet"); // name (text) -> out (text)
    await page.waitForSelector(tid("port-python-in-name"));
    // React Flow draws an edge once its handles are measured: wait for both edges, on the op's ports.
    const want = ["rf__edge-input.value->python.name", "rf__edge-python.out->output.value"];
    const kept = await page.waitForFunction(
      (w) => JSON.stringify([...document.querySelectorAll(".react-flow__edge")].map((e) => e.dataset.testid).sort()) === JSON.stringify(w),
      want, { timeout: 5000 }).then(() => true, () => false);
    expect(kept, `the edges drawn before the op was picked: ${await edgeIds()}`);
    for (const one of [tid("validity"), tid("editor-name"), ".editor-sub"]) {
      const box = await page.locator(one).boundingBox();
      expect(box.height <= 32, `${one} keeps one line: ${box.height} px tall`);
    }
    // The name and its state stay clear of the tools beside them.
    const [title, tools] = [await page.locator(".editor-title").boundingBox(), await page.locator(".editor-tools").boundingBox()];
    expect(!overlaps(title, tools), `the title ${JSON.stringify(title)} runs into the tools ${JSON.stringify(tools)}`);
    const sub = await page.$eval(".editor-sub", (el) => el.scrollWidth <= el.clientWidth);
    expect(sub, "the name's state line shows whole");
    await shot("editor-first-workflow-1024");
  });

  await step("a saved version with issues cannot be run", async () => {
    await page.setViewportSize({ width: 1024, height: 768 });
    await page.goto(`${BASE}/workflows`);
    await page.click(tid("new-workflow"));
    await page.fill(`${tid("create-dialog")} input[name="name"]`, `a-draft-${Date.now()}`);
    await page.click(tid("create-submit"));
    await page.waitForSelector(tid("palette-python"));
    const before = consoleErrors.length;
    await page.dragAndDrop(tid("palette-python"), tid("canvas"), { targetPosition: { x: 300, y: 260 } });
    await page.waitForSelector(tid("node-python"));
    await validityShows(page, "issue");
    const count = Number((await page.locator(tid("validity")).textContent()).match(/(\d+) issues?/)[1]);
    expect(count === 2, `a python node without its op has 2 issues (no op, input x unconnected), not ${count}`);
    await page.click(tid("save"));
    await page.click(tid("save-submit"));
    await waitText(".editor-sub", "v1");
    const run = page.locator(tid("run"));
    expect(await run.isDisabled(), "Run is disabled for a saved version with issues");
    const title = await run.getAttribute("title");
    const want = `v1 has ${count} issue${count === 1 ? "" : "s"}: fix and save to run it`;
    expect(title === want, `the Run button says ${JSON.stringify(title)}, not ${JSON.stringify(want)}`);
    await run.hover({ force: true });
    await shot("editor-draft-cannot-run");
    const noisy = consoleErrors.slice(before);
    expect(noisy.length === 0, `editing an incomplete graph logged console errors: ${noisy.join(" | ")}`);
  });

  expectQuietConsole();
} finally {
  await finish();
}
