// The console's journey in a real browser: Debian's chromium, or Debian's
// firefox-esr over WebDriver BiDi, driven by playwright-core (which
// downloads no browser), against `automesh dev`
// started here on ephemeral ports, with a fake model provider that speaks
// the OpenAI wire protocol (the one thing outside the project) and holds
// a run's first answer until the test releases it, so that the run page is
// seen receiving its events live.
//
//   AUTOMESH_BIN        the automesh binary (default: ../../target/debug/automesh)
//   AUTOMESH_BROWSER    chromium (default) or firefox
//   AUTOMESH_CHROMIUM   Chromium (default: /usr/bin/chromium)
//   AUTOMESH_FIREFOX    Firefox (default: /usr/bin/firefox-esr)
//   AUTOMESH_BROWSER_ARTIFACTS  where screenshots go (default: ../../target/browser-artifacts)
//
// Every wait is bounded; a failed step names itself, prints dev's output and
// exits non-zero.
import { chromium, firefox } from "playwright-core";
import { spawn, execFileSync } from "node:child_process";
import fs from "node:fs";
import http from "node:http";
import os from "node:os";
import path from "node:path";
import { fileURLToPath } from "node:url";

const here = path.dirname(fileURLToPath(import.meta.url));
const bin = process.env.AUTOMESH_BIN || path.resolve(here, "../../target/debug/automesh");
const browserName = process.env.AUTOMESH_BROWSER || "chromium";
if (!["chromium", "firefox"].includes(browserName)) throw new Error(`AUTOMESH_BROWSER is chromium or firefox, not ${browserName}`);
const artifacts = path.join(process.env.AUTOMESH_BROWSER_ARTIFACTS || path.resolve(here, "../../target/browser-artifacts"), browserName);
fs.mkdirSync(artifacts, { recursive: true });

// Strings that would run script if any page put them into HTML unescaped.
const XSS_NAME = `<script>window.__xss="name"</script><img src=x onerror="window.__xss='img'">`;
const XSS_PROMPT = `Summarise <script>window.__xss="prompt"</script> and follow javascript:window.__xss="url" [hold]`;
const XSS_ANSWER = `Done. <img src=x onerror="window.__xss='answer'"><script>window.__xss="answer"</script> <a href="javascript:window.__xss='link'">link</a>`;
const XSS_TOOL_QUERY = `<svg onload="window.__xss='tool'">`;

let step = "start";
const log = (m) => console.log(`[journey] ${m}`);
const begin = (name) => {
  step = name;
  log(name);
};

// ---- a fake model provider (OpenAI chat completions) ----
const releases = [];
let released = false;
const provider = http.createServer(async (req, res) => {
  let text = "";
  for await (const c of req) text += c;
  if (!req.url.endsWith("/chat/completions")) {
    res.writeHead(200, { "content-type": "application/json" });
    res.end(JSON.stringify({ object: "list", data: [{ id: "fake", object: "model" }] }));
    return;
  }
  const body = JSON.parse(text);
  const user = body.messages
    .filter((m) => m.role === "user")
    .map((m) => (typeof m.content === "string" ? m.content : JSON.stringify(m.content)))
    .join(" ");
  const afterTool = body.messages.some((m) => m.role === "tool");
  if (user.includes("[hold]") && !afterTool && !released) {
    await new Promise((resolve) => releases.push(resolve));
  }
  if (user.includes("[never]") && !afterTool) {
    // Held until the engine gives up on it (a cancelled run).
    await new Promise((resolve) => req.on("close", resolve));
    return;
  }
  const call = !afterTool && (body.tools || []).some((t) => t.function?.name === "search_capabilities");
  const message = call
    ? { role: "assistant", content: null, tool_calls: [{ id: "call_1", type: "function", function: { name: "search_capabilities", arguments: JSON.stringify({ query: XSS_TOOL_QUERY }) } }] }
    : { role: "assistant", content: XSS_ANSWER };
  const finish = call ? "tool_calls" : "stop";
  const usage = { prompt_tokens: 1200, completion_tokens: 300, total_tokens: 1500 };
  const id = "chatcmpl-fake";
  if (!body.stream) {
    res.writeHead(200, { "content-type": "application/json" });
    res.end(JSON.stringify({ id, object: "chat.completion", model: "fake", choices: [{ index: 0, message, finish_reason: finish }], usage }));
    return;
  }
  const chunk = (delta, finish_reason) => ({ id, object: "chat.completion.chunk", model: "fake", choices: [{ index: 0, delta, finish_reason }] });
  const events = [chunk({ role: "assistant" }, null)];
  if (call) {
    events.push(chunk({ tool_calls: [{ index: 0, ...message.tool_calls[0] }] }, null));
  } else {
    events.push(chunk({ content: XSS_ANSWER }, null));
  }
  events.push(chunk({}, finish));
  if (body.stream_options?.include_usage) events.push({ id, object: "chat.completion.chunk", model: "fake", choices: [], usage });
  res.writeHead(200, { "content-type": "text/event-stream" });
  res.end(events.map((e) => `data: ${JSON.stringify(e)}\n\n`).join("") + "data: [DONE]\n\n");
});
await new Promise((r) => provider.listen(0, "127.0.0.1", r));
const providerUrl = `http://127.0.0.1:${provider.address().port}/v1`;

// ---- automesh dev ----
const dataDir = fs.mkdtempSync(path.join(os.tmpdir(), "automesh-console-journey-"));
const listens = ["gateway", "runner-gateway", "runner-gateway-internal", "scheduler", "coordinator", "lifecycle", "console", "metrics"];
const dev = spawn(bin, ["dev", "--data-dir", dataDir, ...listens.flatMap((l) => [`--${l}-listen`, "127.0.0.1:0"])], {
  env: { ...process.env, AUTOMESH_WORKER_PROVIDER_URL: providerUrl, AUTOMESH_WORKER_PROVIDER_API_KEY: "fake-provider-key", RUST_LOG: "warn" },
  stdio: ["ignore", "pipe", "pipe"],
});
let devOutput = "";
dev.stderr.on("data", (d) => (devOutput += d));
const banner = await new Promise((resolve, reject) => {
  let out = "";
  const timer = setTimeout(() => reject(new Error("automesh dev did not print `ready` within 60 s")), 60_000);
  dev.stdout.on("data", (d) => {
    out += d;
    devOutput += d;
    if (/^ready$/m.test(out)) {
      clearTimeout(timer);
      resolve(out);
    }
  });
  dev.on("exit", (code) => reject(new Error(`automesh dev exited early (${code})`)));
});
const address = (label) => banner.match(new RegExp(`^\\s+${label}\\s+(http://\\S+)`, "m"))[1];
const consoleUrl = address("console");
const gateway = address("public gateway");
const devToken = fs.readFileSync(path.join(dataDir, "dev-token"), "utf8").trim();
log(`console at ${consoleUrl}, gateway at ${gateway}`);
const ctl = (...args) => execFileSync(bin, ["ctl", "--addr", gateway, "--data-dir", dataDir, ...args], { encoding: "utf8", timeout: 30_000 });
const field = (out, name) => out.match(new RegExp(`^${name}:\\s+(.*)$`, "m"))[1].trim();

// ---- the browser ----
const browser = browserName === "chromium"
  ? await chromium.launch({
      executablePath: process.env.AUTOMESH_CHROMIUM || "/usr/bin/chromium",
      args: ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking", "--disable-component-update", "--disable-sync"],
      timeout: 60_000,
    })
  // The stock Firefox, over WebDriver BiDi (playwright-core's "moz-" channels).
  : await firefox.launch({
      channel: "moz-firefox",
      executablePath: process.env.AUTOMESH_FIREFOX || "/usr/bin/firefox-esr",
      headless: true,
      timeout: 60_000,
    });
log(`browser: ${browserName} ${browser.version()}`);
// A zone with DST, as the browser's own.
const context = await browser.newContext({ timezoneId: "America/New_York" });
const page = await context.newPage();
page.setDefaultTimeout(30_000);
const dialogs = [];
page.on("dialog", (d) => {
  dialogs.push(d.message());
  d.dismiss();
});
let shot = 0;
async function check(name) {
  // No script from untrusted text ran, the token is nowhere in the page or its URL.
  const xss = await page.evaluate(() => window.__xss);
  if (xss !== undefined) throw new Error(`script from untrusted text ran on ${name}: ${xss}`);
  if (dialogs.length) throw new Error(`a dialog opened on ${name}: ${dialogs}`);
  const html = await page.content();
  if (html.includes(devToken) || page.url().includes(devToken)) throw new Error(`the session token appears on ${name}`);
  await page.screenshot({ path: path.join(artifacts, `${String(++shot).padStart(2, "0")}-${name}.png`), fullPage: true });
}
const text = (selector) => page.locator(selector).first().innerText();
async function until(what, fn, ms = 30_000) {
  const end = Date.now() + ms;
  for (;;) {
    const v = await fn();
    if (v) return v;
    if (Date.now() > end) throw new Error(`timed out after ${ms} ms waiting for ${what}`);
    await new Promise((r) => setTimeout(r, 200));
  }
}

let failed = null;
try {
  begin("sign in with one click");
  await page.goto(consoleUrl);
  await page.waitForURL(/\/sign-in/);
  await check("sign-in");
  await page.click("#dev-sign-in");
  await page.waitForSelector("h1:text('Automations')");
  await check("automations-empty");

  begin("create a weekly cloud automation in a zone with DST, preview first");
  await page.click("text=New automation");
  await page.waitForSelector("#automation-form");
  if ((await page.inputValue("#zone")) !== "America/New_York") throw new Error("the browser's zone is not preselected");
  if (await page.locator("text=/placement/i").locator("select").count()) throw new Error("a placement picker is shown");
  await page.fill("#name", XSS_NAME);
  await page.fill("#prompt", XSS_PROMPT);
  await page.check("input[name=kind][value=weekly]");
  await page.check("input[name=days][value='1']");
  await page.check("input[name=days][value='4']");
  await page.fill("#time", "09:30");
  await page.waitForSelector("#preview table.preview tbody tr >> nth=4");
  const preview = await text("#preview");
  if (!/Thu/.test(await page.locator("#preview").innerHTML()) && !/E[SD]T/.test(preview)) throw new Error(`preview lacks zone names: ${preview}`);
  if (!/UTC/.test(preview) || !/offset changes/.test(preview)) throw new Error(`preview lacks UTC or the DST change: ${preview}`);
  await check("create-preview");
  await page.click("button:text('Create automation')");
  await page.waitForSelector("dl.facts");
  const cloudUrl = page.url();
  const cloudId = cloudUrl.split("/automations/")[1].split("?")[0];
  if ((await text("h1")) !== XSS_NAME) throw new Error(`the name is not shown as text: ${await text("h1")}`);
  if ((await text("dl.facts .placement")) !== "cloud") throw new Error("the web creates cloud automations");
  await check("automation");

  begin("run now, and watch the thread arrive live");
  await page.click("#run-now");
  await page.waitForURL(/\/runs\//);
  await page.waitForSelector("#thread[data-live=true]");
  const before = await page.locator("#thread li").count();
  await check("run-live-waiting");
  await until("the fake provider to be asked", () => releases.length > 0, 60_000);
  released = true;
  releases.splice(0).forEach((r) => r());
  await page.waitForSelector("#run-state:text('succeeded')", { timeout: 60_000 });
  await page.waitForSelector("#live-status:text('The run is over.')");
  const after = await page.locator("#thread li").count();
  if (after <= before) throw new Error(`no event arrived live (${before} → ${after})`);
  const seqs = await page.locator("#thread li").evaluateAll((ls) => ls.map((l) => Number(l.dataset.seq)));
  if (new Set(seqs).size !== seqs.length || seqs.some((s, i) => i && s <= seqs[i - 1])) throw new Error(`events repeated or out of order: ${seqs}`);
  const thread = await text("#thread");
  if (!thread.includes(`<img src=x onerror="window.__xss='answer'">`)) throw new Error("the model's answer is not shown as text");
  if (!thread.includes("search_capabilities") || !thread.includes("svg onload")) throw new Error("the tool call and its arguments are not shown");
  const cost = await text("#receipt-cost");
  if (!/^\$0\.\d{6}$/.test(cost) || cost === "$0.000000") throw new Error(`the receipt has no cost: ${cost}`);
  if (!/per million input tokens/.test(await text("#receipt"))) throw new Error("the receipt lacks its price");
  if (!/^[0-9a-f]{32}$/.test(await text("#trace-id"))) throw new Error("no trace id");
  await check("run-receipt");

  begin("the automation's spend this month and over 30 days, with its chart");
  await page.goto(`${consoleUrl}/automations/${cloudId}`);
  const month = await text("#spend-month");
  if (!/^\$0\.\d{6} · \d+ tokens$/.test(month) || month.startsWith("$0.000000")) throw new Error(`no spend this month: ${month}`);
  const bars = await page.locator("svg.chart rect").evaluateAll((rs) => rs.filter((r) => Number(r.getAttribute("height")) > 0).length);
  if (bars < 1) throw new Error("the spend chart draws no day");
  const lastRun = await page.locator("table.runs tbody tr").count();
  if (lastRun < 1) throw new Error("the run history is empty");
  await page.goto(consoleUrl + "/");
  const lastCell = await page.locator(`tr[data-automation="${cloudId}"] td`).nth(6).innerText();
  if (!/succeeded · \$0\.\d{6}/.test(lastCell)) throw new Error(`the list does not show the last run and its cost: ${lastCell}`);
  await check("automation-spend");

  begin("a desktop automation made through the API shows its placement");
  const desk = ctl("create", "--name", "desk-report", "--prompt", "report [never]", "--surface", "desktop", "--daily", "08:00", "--tz", "Europe/Paris");
  const deskId = field(desk, "id");
  await page.goto(consoleUrl + "/?sort=name");
  const deskRow = page.locator(`tr[data-automation="${deskId}"]`);
  if ((await deskRow.locator(".placement").innerText()) !== "desktop") throw new Error("the desktop label is missing");
  await check("list-with-desktop");

  begin("a stale edit shows a conflict with both versions");
  await page.goto(`${consoleUrl}/automations/${cloudId}/edit`);
  await page.fill("#name", "my edit");
  ctl("update", cloudId, "--name", "their edit");
  await page.click("button:text('Save changes')");
  await page.waitForSelector(".conflict");
  const conflict = await text(".conflict");
  if (!conflict.includes("my edit") || !conflict.includes("their edit")) throw new Error(`the conflict lacks a version: ${conflict}`);
  const stored = field(ctl("get", cloudId), "name");
  if (stored !== "their edit") throw new Error(`the other change was overwritten: ${stored}`);
  await check("edit-conflict");

  begin("cancel a run that is still going");
  const held = ctl("create", "--name", "held", "--prompt", "wait [never]", "--surface", "web", "--daily", "07:00", "--tz", "UTC");
  const heldId = field(held, "id");
  await page.goto(`${consoleUrl}/automations/${heldId}`);
  await page.click("#run-now");
  await page.waitForURL(/\/runs\//);
  await page.waitForSelector("#cancel");
  await page.click("#cancel");
  await page.waitForSelector("#run-state:text('cancelled')", { timeout: 90_000 });
  await check("run-cancelled");

  begin("pause and resume in bulk");
  await page.goto(consoleUrl + "/");
  for (const id of [cloudId, deskId]) await page.check(`#select-${id}`);
  await page.click("button:text('Pause selected')");
  await page.waitForSelector("p.notice:text('Paused 2.')");
  for (const id of [cloudId, deskId]) {
    const s = await page.locator(`tr[data-automation="${id}"] .state`).innerText();
    if (s !== "paused") throw new Error(`${id} is ${s} after a bulk pause`);
  }
  await check("bulk-paused");
  for (const id of [cloudId, deskId]) await page.check(`#select-${id}`);
  await page.click("button:text('Resume selected')");
  await page.waitForSelector("p.notice:text('Resumed 2.')");
  for (const id of [cloudId, deskId]) {
    const s = await page.locator(`tr[data-automation="${id}"] .state`).innerText();
    if (s !== "active") throw new Error(`${id} is ${s} after a bulk resume`);
  }
  await check("bulk-resumed");

  begin("the time toggle switches every time to UTC");
  await page.click("#time-toggle");
  await page.waitForSelector("#time-toggle[data-mode=utc]");
  const times = await page.locator("main time").allInnerTexts();
  if (!times.length || times.some((t) => !t.endsWith("UTC"))) throw new Error(`times not in UTC: ${times}`);
  await check("times-utc");

  begin("another user's automation is the unknown id's 404");
  const other = ctl("token", "--user", "eve", "--org", "dev");
  const response = await page.goto(`${consoleUrl}/automations/does-not-exist`);
  if (response.status() !== 404) throw new Error(`unknown id answered ${response.status()}`);
  const evesId = field(execFileSync(bin, ["ctl", "--addr", gateway, "--token", other.trim().split("\n").pop(), "create", "--name", "eve's", "--prompt", "p", "--surface", "desktop", "--daily", "07:00", "--tz", "UTC"], { encoding: "utf8", timeout: 30_000 }), "id");
  const eves = await page.goto(`${consoleUrl}/automations/${evesId}`);
  if (eves.status() !== 404) throw new Error(`another user's automation answered ${eves.status()}`);
  await check("not-found");

  begin("archive");
  await page.goto(`${consoleUrl}/automations/${cloudId}`);
  await page.click("#archive");
  await page.waitForSelector(".state:text('archived')");
  await check("archived");

  begin("runners: online with last seen, mint a token shown once, revoke");
  await page.goto(consoleUrl + "/runners");
  const online = await page.locator("table.runners tbody tr", { hasText: "online" }).count();
  if (online !== 1) throw new Error(`the dev runner is not listed online (${online})`);
  await page.fill("#runner_name", "spare-laptop");
  await page.click("button:text('Mint a runner token')");
  const minted = await text("#minted-token");
  const spareId = await text("#minted-runner");
  if (minted.length < 20) throw new Error(`no token shown: ${minted}`);
  await check("runner-minted");
  await page.goto(consoleUrl + "/runners");
  const spare = page.locator(`tr[data-runner="${spareId}"]`);
  if (!(await spare.innerText()).includes("offline")) throw new Error("a runner never connected is not offline");
  if ((await page.content()).includes(minted)) throw new Error("the token is shown again");
  await spare.locator("button:text('Revoke')").click();
  await page.waitForSelector("p.notice:text('Revoked.')");
  if (await page.locator(`tr[data-runner="${spareId}"]`).count()) throw new Error("a revoked runner is still listed");
  await check("runners");

  begin("with no runner connected, a desktop automation warns on its card and before run-now");
  const devRunner = page.locator("table.runners tbody tr", { hasText: "online" });
  await devRunner.locator("button:text('Revoke')").click();
  await page.waitForSelector("p.notice:text('Revoked.')");
  await page.goto(consoleUrl + "/?sort=name");
  const warned = await page.locator(`tr[data-automation="${deskId}"] .warning`).innerText();
  if (!warned.includes("no runner connected")) throw new Error(`the desktop card does not warn: ${warned}`);
  await page.goto(`${consoleUrl}/automations/${deskId}`);
  if (!(await text("p.warning")).includes("runner_offline")) throw new Error("the automation page does not warn");
  // The page-wide handler dismisses it (the run is not started) and keeps
  // what it said.
  await page.click("#run-now");
  await until("the run-now confirmation", () => dialogs.length > 0, 10_000);
  const asked = dialogs.splice(0).join(" ");
  if (!asked.includes("runner_offline")) throw new Error(`run-now did not warn: ${asked}`);
  if (!page.url().includes(`/automations/${deskId}`)) throw new Error("a dismissed run-now still started a run");
  await check("runner-offline-warning");

  begin("deactivate with a reason, shown afterwards");
  await page.fill("#pause-reason-input", "on holiday <b>until</b> Monday");
  await page.click("#deactivate");
  await page.waitForSelector("#pause-reason");
  if (!(await text("#pause-reason")).includes("on holiday <b>until</b> Monday")) throw new Error("the pause reason is not shown as text");
  await page.goto(consoleUrl + "/?sort=name");
  if (!(await page.locator(`tr[data-automation="${deskId}"]`).innerText()).includes("Paused: on holiday")) throw new Error("the list does not show the pause reason");
  await check("paused-with-reason");

  begin("sign out");
  await page.click("button:text('Sign out')");
  await page.waitForSelector("text=You are signed out.");
  await page.goto(consoleUrl + "/");
  await page.waitForURL(/\/sign-in/);
  await check("signed-out");
  log("every step passed");
} catch (e) {
  failed = e;
  console.error(`[journey] FAILED at "${step}": ${e.stack || e}`);
  try {
    await page.screenshot({ path: path.join(artifacts, `failed-${step.replace(/\W+/g, "-")}.png`), fullPage: true });
  } catch {}
} finally {
  await browser.close().catch(() => {});
  dev.kill("SIGTERM");
  provider.closeAllConnections();
  provider.close();
  await new Promise((r) => setTimeout(r, 500));
  fs.rmSync(dataDir, { recursive: true, force: true });
}
if (failed) {
  console.error("---- automesh dev output ----\n" + devOutput.slice(-20_000));
  process.exit(1);
}
