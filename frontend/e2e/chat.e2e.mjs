// A plain question on the chat workflow's New run form, in a real Chromium against a live studio.
//
//   STUDIO_URL=... STUDIO_USER=... STUDIO_PASSWORD=... E2E_ARTIFACTS=... node e2e/chat.e2e.mjs
//
// tests/e2e/test_chat_e2e.py runs it against the studio of tests/e2e/conftest.py (issue #20: a
// user who typed "What is the capital of France?" into the `chat` workflow's prompt got an empty
// answer, the llm node reading the text as the model's own prompt):
//  - the prompt input shows a "Chat message" toggle, on, with its hint, and starts from the plain
//    question (the input's example), not the template text of its default;
//  - the run's prompt is the question in smollm2-135m's chat template (as the studio's
//    chat-template endpoint renders it), and its answer, on the run page, mentions Paris;
//  - "Run again" starts from that rendered prompt, says it is sent as it is, and sends it unchanged;
//  - the toggle off sends the exact text typed.
// Every step leaves a screenshot in E2E_ARTIFACTS; a failing one FAILED-<step>.png, and exits 1.

import { expect, logIn, openBrowser, tid } from "./harness.mjs";

const BASE = process.env.STUDIO_URL ?? "http://127.0.0.1:8000";
const USER = process.env.STUDIO_USER ?? "demo";
const PASSWORD = process.env.STUDIO_PASSWORD ?? "demo";
const QUESTION = "What is the capital of France?";
const PROMPT = `${tid("input-prompt")} textarea`;
const TOGGLE = `${tid("chat-toggle-prompt")} input[type="checkbox"]`;
const HINT = tid("input-hint-prompt");

const { page, shot, step, waitText, expectQuietConsole, finish } = await openBrowser("chat", { wait: 30_000 });
const runIdOf = (url) => url.split("/runs/")[1].replace(/[/?#].*$/, "");
const api = (path, body) =>
  page.evaluate(async ([p, b]) => {
    const { csrf_token: csrf } = await (await fetch("/api/auth/session/")).json();
    const init = b === undefined ? {} : {
      method: "POST", headers: { "Content-Type": "application/json", "X-CSRFToken": csrf }, body: JSON.stringify(b),
    };
    return (await fetch(p, init)).json();
  }, [path, body]);

/** Submit the form, wait for its run to end on the run page; the run's detail. */
async function runToTheEnd() {
  await page.click(tid("submit-run"));
  await page.waitForURL(/\/runs\/[0-9a-f-]+$/);
  await page.waitForSelector(tid("run-page"));
  await waitText(tid("run-status"), "done", 120_000); // the first run loads the model
  return api(`/api/runs/${runIdOf(page.url())}/`);
}

try {
  await step("login", () => logIn(page, BASE, USER, PASSWORD));

  let rendered = "";
  await step("the chat workflow's prompt takes a plain question as a chat message", async () => {
    await page.locator(`${tid("workflow-row-chat")} .row-title`).click();
    await page.waitForSelector(tid("editor"));
    await page.click(tid("run"));
    await page.waitForSelector(tid("run-form"));
    await page.waitForSelector(TOGGLE);
    expect(await page.isChecked(TOGGLE), "the Chat message toggle is on by default");
    await waitText(HINT, "chat template");
    // A newcomer's first run: the form starts from the plain question (the input's example), not
    // from the template text its default is.
    expect((await page.inputValue(PROMPT)) === QUESTION, `the form starts from the plain question: ${
      JSON.stringify(await page.inputValue(PROMPT))}`);
    const hint = (await page.textContent(HINT)) ?? "";
    expect(hint.includes("smollm2-135m's chat template") && !hint.includes("already"),
      `the hint says the question goes in the model's template: ${hint}`);
    rendered = (await api("/api/models/smollm2-135m/chat-template/", {
      messages: [{ role: "user", content: QUESTION }],
    })).prompt;
    expect(rendered.includes(`<|im_start|>user\n${QUESTION}<|im_end|>\n<|im_start|>assistant\n`),
      `the studio renders the question in SmolLM2's template: ${JSON.stringify(rendered)}`);
    await shot("chat-form-plain-question");
  });

  await step("the answer mentions Paris", async () => {
    const run = await runToTheEnd();
    expect(run.inputs.prompt === rendered, `the run's prompt is the rendered question: ${JSON.stringify(run.inputs.prompt)}`);
    const answer = page.locator(`${tid("output-text")} .output-text`);
    await answer.waitFor();
    const text = ((await answer.textContent()) ?? "").trim();
    expect(text !== "" && text.includes("Paris"), `the answer shown mentions Paris: ${JSON.stringify(text)}`);
    expect(run.outputs.text === text, `the page shows the run's answer: ${JSON.stringify(run.outputs.text)}`);
    console.log(`     answer: ${text}`);
    await shot("chat-answer-paris");
  });

  await step("Run again sends the rendered prompt as it is", async () => {
    await page.click(tid("run-again"));
    await page.waitForSelector(tid("run-again-from"));
    await page.waitForFunction((s) => document.querySelector(s)?.value !== "", PROMPT);
    expect((await page.inputValue(PROMPT)) === rendered, "the form starts from the rendered prompt");
    await page.waitForSelector(TOGGLE);
    await waitText(HINT, "already in smollm2-135m's chat template");
    await shot("chat-run-again-rendered");
    const run = await runToTheEnd();
    expect(run.inputs.prompt === rendered, `sent unchanged, not rendered twice: ${JSON.stringify(run.inputs.prompt)}`);
    expect(run.outputs.text.includes("Paris"), `the same answer: ${JSON.stringify(run.outputs.text)}`);
  });

  await step("with the toggle off, the exact text typed is sent", async () => {
    await page.click(tid("run-again"));
    await page.waitForSelector(tid("run-again-from"));
    await page.waitForFunction((s) => document.querySelector(s)?.value !== "", PROMPT);
    await page.waitForSelector(TOGGLE);
    await page.fill(PROMPT, QUESTION);
    await page.uncheck(TOGGLE);
    const hint = (await page.textContent(HINT)) ?? "";
    expect(hint.includes("plain text sent as it is may get an empty reply"), `the input's own description shows: ${hint}`);
    await shot("chat-toggle-off");
    const run = await runToTheEnd();
    expect(run.inputs.prompt === QUESTION, `the typed text, unchanged: ${JSON.stringify(run.inputs.prompt)}`);
  });

  expectQuietConsole();
} finally {
  await finish();
}
