// Runs the example (dist/main.js) against a fresh `automesh dev`: every
// listener on an ephemeral loopback port, a new data directory, and the
// built-in demo model and demo Connect endpoint (no outside provider, so
// every AUTOMESH_* variable of this environment is kept from dev). Exits
// with the example's status.
//
//   AUTOMESH_BIN   the automesh binary (default: ../../target/debug/automesh)
//
// Build the example first (`npm run build`). Every wait is bounded and a
// failed one names itself; on failure dev's output is printed.
import { spawn } from "node:child_process";
import fs from "node:fs";
import os from "node:os";
import path from "node:path";
import { fileURLToPath } from "node:url";

const here = path.dirname(fileURLToPath(import.meta.url));
const bin = process.env.AUTOMESH_BIN || path.resolve(here, "../../target/debug/automesh");
const example = path.join(here, "dist", "main.js");

const DEV_READY_MS = 60_000;
const EXAMPLE_MS = 120_000;
const DEV_STOP_MS = 10_000;
const DEV_KILL_MS = 5_000;

const log = (m) => console.log(`[run-against-dev] ${m}`);

if (!fs.existsSync(bin)) {
  console.error(`[run-against-dev] no automesh binary at ${bin} (build it, or set AUTOMESH_BIN)`);
  process.exit(1);
}
if (!fs.existsSync(example)) {
  console.error(`[run-against-dev] ${example} is missing: run \`npm ci && npm run build\` in ${here}`);
  process.exit(1);
}

// Dev gets this environment less its AUTOMESH_* variables: no configured
// provider, Connect endpoint or database, so it serves its own demo ones.
const devEnv = Object.fromEntries(Object.entries(process.env).filter(([k]) => !k.startsWith("AUTOMESH_")));
devEnv.RUST_LOG = "warn";

const dataDir = fs.mkdtempSync(path.join(os.tmpdir(), "automesh-typescript-example-"));
const listens = ["gateway", "runner-gateway", "runner-gateway-internal", "scheduler", "coordinator", "lifecycle", "console", "metrics"];
// In a process group of its own: the cloud worker agents dev starts outlive
// it by design (until their orphan bound, 60 s), so the group is what is
// stopped at the end.
const dev = spawn(bin, ["dev", "--data-dir", dataDir, ...listens.flatMap((l) => [`--${l}-listen`, "127.0.0.1:0"])], {
  env: devEnv,
  stdio: ["ignore", "pipe", "pipe"],
  detached: true,
});
let devOutput = "";
let devExited = null;
dev.on("exit", (code, signal) => (devExited = signal ?? code));
dev.on("error", (e) => (devExited = `could not start: ${e.message}`));
dev.stderr.on("data", (d) => (devOutput += d));
dev.stdout.on("data", (d) => (devOutput += d));

/** Resolves with what `until` returns once it is truthy, within `ms`, or fails naming `what`. */
function waitFor(what, ms, until) {
  return new Promise((resolve, reject) => {
    const check = () => {
      if (devExited !== null) return done(new Error(`automesh dev exited (${devExited}) while waiting for ${what}`));
      const v = until();
      if (v) done(null, v);
    };
    const timer = setTimeout(() => done(new Error(`timed out after ${ms} ms waiting for ${what}`)), ms);
    const poll = setInterval(check, 100);
    function done(err, v) {
      clearTimeout(timer);
      clearInterval(poll);
      err ? reject(err) : resolve(v);
    }
    check();
  });
}

/** Sends `signal` to dev's process group; false when no process is left in it. */
function signalDevGroup(signal) {
  try {
    process.kill(-dev.pid, signal);
    return true;
  } catch {
    return false;
  }
}

/** True once nothing is left in dev's process group, within `ms`. */
async function devGroupGone(ms) {
  const end = Date.now() + ms;
  while (signalDevGroup(0)) {
    if (Date.now() > end) return false;
    await new Promise((r) => setTimeout(r, 100));
  }
  return true;
}

/** SIGTERM to dev and the worker agents it started, then SIGKILL to what is left after a bound. */
async function stopDev() {
  if (dev.pid === undefined) return;
  signalDevGroup("SIGTERM");
  if (await devGroupGone(DEV_STOP_MS)) return;
  log(`automesh dev's processes did not stop within ${DEV_STOP_MS} ms of SIGTERM: SIGKILL`);
  signalDevGroup("SIGKILL");
  if (!(await devGroupGone(DEV_KILL_MS))) log(`automesh dev's process group ${dev.pid} is still there ${DEV_KILL_MS} ms after SIGKILL`);
}

/** Runs the example to its end, or kills it after `ms`; resolves with its exit status. */
function runExample(env, ms) {
  return new Promise((resolve, reject) => {
    const child = spawn(process.execPath, [example], { env, stdio: ["ignore", "inherit", "inherit"] });
    const timer = setTimeout(() => {
      child.kill("SIGKILL");
      reject(new Error(`the example did not finish within ${ms} ms`));
    }, ms);
    child.on("error", (e) => {
      clearTimeout(timer);
      reject(new Error(`the example could not start: ${e.message}`));
    });
    child.on("exit", (code, signal) => {
      clearTimeout(timer);
      resolve(code ?? (signal ? 128 + (os.constants.signals[signal] ?? 0) : 1));
    });
  });
}

// Stop dev when this script is stopped.
for (const sig of ["SIGINT", "SIGTERM"]) {
  process.on(sig, async () => {
    await stopDev();
    fs.rmSync(dataDir, { recursive: true, force: true });
    process.exit(130);
  });
}

let status = 1;
try {
  const banner = await waitFor("automesh dev to print `ready`", DEV_READY_MS, () => /^ready$/m.test(devOutput) && devOutput);
  const match = (label) => banner.match(new RegExp(`^\\s+${label}\\s+(\\S+)(.*)$`, "m"));
  const gateway = match("public gateway")?.[1];
  if (!gateway) throw new Error("no `public gateway` address in dev's banner");
  const provider = match("model provider");
  if (!provider || !/DEMO/.test(provider[2])) throw new Error("dev is not serving its built-in demo model");
  const tokenFile = path.join(dataDir, "dev-token");
  const token = await waitFor(`the dev token in ${tokenFile}`, 5_000, () => fs.existsSync(tokenFile) && fs.readFileSync(tokenFile, "utf8").trim());
  const address = gateway.replace(/^http:\/\//, "");
  log(`automesh dev is ready: public gateway ${address}, demo model at ${provider[1]}`);

  log(`node dist/main.js (AUTOMESH_GATEWAY=${address})`);
  status = await runExample({ ...process.env, AUTOMESH_GATEWAY: address, AUTOMESH_TOKEN: token }, EXAMPLE_MS);
  log(`the example exited ${status}`);
} catch (e) {
  console.error(`[run-against-dev] FAILED: ${e.message}`);
  status = 1;
} finally {
  await stopDev();
  fs.rmSync(dataDir, { recursive: true, force: true });
}
if (status !== 0) console.error("---- automesh dev output (last 20,000 characters) ----\n" + devOutput.slice(-20_000));
process.exit(status);
