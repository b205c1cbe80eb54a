"""Chat on deployments of chat workflows: the OpenAI-compatible `/v1/chat/completions` and
`/v1/models`, and server-side chat sessions.

* `shape` — what makes a spec a chat workflow, and where its prompt, images and reply are;
* `templates` — OpenAI messages to a prompt (the model's chat template, or a simple one);
* `openai` — the request's validation and the response shapes;
* `turns` — one chat turn as a run on the deployment, followed to its end;
* `views` — the async HTTP views (SSE streaming).
"""
