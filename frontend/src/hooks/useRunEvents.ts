/**
 * A run's events, live: the WebSocket `/ws/runs/<id>/?since=N`, resumed from the next
 * sequence number after a drop, and REST polling of `/events/` if the socket cannot be
 * opened at all. Events arrive in `seq` order with no gaps or repeats; the stream ends
 * with `run_finished`.
 */
import { useEffect, useRef, useState } from "react";
import { wsUrl } from "../api/client";
import { runs } from "../api/studio";
import type { RunEvent } from "../api/types";

export type StreamState = "connecting" | "live" | "polling" | "reconnecting" | "closed";

export function useRunEvents(runId: string | undefined, onEvents: (events: RunEvent[]) => void): StreamState {
  const [state, setState] = useState<StreamState>("connecting");
  const handler = useRef(onEvents);
  handler.current = onEvents;

  useEffect(() => {
    if (!runId) return;
    let next = 0;
    let finished = false;
    let stopped = false;
    let socket: WebSocket | null = null;
    let timer: number | undefined;
    let failures = 0;

    const deliver = (events: RunEvent[]) => {
      const fresh = events.filter((e) => e.seq >= next).sort((a, b) => a.seq - b.seq);
      const inOrder: RunEvent[] = [];
      for (const e of fresh) {
        if (e.seq !== next) break; // a gap: the next connection resumes from `next`
        inOrder.push(e);
        next = e.seq + 1;
        if (e.type === "run_finished") finished = true;
      }
      if (inOrder.length) handler.current(inOrder);
    };

    const poll = async () => {
      if (stopped) return;
      setState("polling");
      try {
        deliver(await runs.events(runId, next));
      } catch {
        // The next poll tries again.
      }
      if (finished) setState("closed");
      else timer = window.setTimeout(poll, 1000);
    };

    const open = () => {
      if (stopped) return;
      let opened = false;
      socket = new WebSocket(wsUrl(`/ws/runs/${runId}/?since=${next}`));
      socket.onopen = () => {
        opened = true;
        failures = 0;
        setState("live");
      };
      socket.onmessage = (msg) => {
        const event = JSON.parse(msg.data as string) as RunEvent | { type: "error"; error: string };
        if (event.type === "error") return;
        deliver([event as RunEvent]);
      };
      socket.onclose = () => {
        socket = null;
        if (stopped) return;
        if (finished) {
          setState("closed");
          return;
        }
        failures += 1;
        if (!opened && failures >= 3) {
          poll();
          return;
        }
        setState("reconnecting");
        timer = window.setTimeout(open, Math.min(500 * 2 ** failures, 5000));
      };
    };

    setState("connecting");
    open();
    return () => {
      stopped = true;
      window.clearTimeout(timer);
      socket?.close();
    };
  }, [runId]);

  return state;
}
