/**
 * Where a run runs: the new-run form's default target ("" is the studio's own engine, otherwise a
 * deployment's id), and how the run list and view name the deployment a run ran on.
 */

/** What the form was opened with (its query string). */
export interface TargetAsked {
  /** `?deployment=`: run on this one (a "Run again" of a run that ran on it). */
  deployment: string | null;
  /** `?version=`: run this version. */
  version: number | null;
  /** `?from=`: a "Run again", which runs where the run it repeats ran. */
  from: string | null;
}

/**
 * The default target: the deployment asked for; else the workflow's running deployment when there is
 * exactly one, unless this repeats a run (which ran on the studio's engine, as it named no deployment)
 * or asks for a version that deployment does not run; else the studio's own engine.
 */
export function defaultTarget(asked: TargetAsked, running: readonly { id: string; version: number }[]): string {
  if (asked.deployment) return asked.deployment;
  if (asked.from || running.length !== 1) return "";
  const [only] = running;
  return asked.version === null || asked.version === only.version ? only.id : "";
}

/** A deployment as a run names it: its name, or (unnamed) the start of its id. */
export function deploymentLabel(run: { deployment: string | null; deployment_name: string | null }): string | null {
  if (!run.deployment) return null;
  return run.deployment_name || run.deployment.slice(0, 8);
}
