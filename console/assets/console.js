// automesh console: the few things a page does in the browser.
// - records the browser's IANA time zone, and the UTC/local toggle, in cookies
//   the server renders times by;
// - preselects the browser's zone in a new automation's zone picker, shows the
//   fields of the chosen schedule kind, and asks the server for the preview;
// - follows a live run over server-sent events.
// No inline script anywhere: the Content-Security-Policy forbids it.
"use strict";

(function () {
  function setCookie(name, value) {
    document.cookie = name + "=" + encodeURIComponent(value) + "; Path=/; SameSite=Strict; Max-Age=31536000";
  }
  function cookie(name) {
    const found = document.cookie.split("; ").find((c) => c.startsWith(name + "="));
    return found ? decodeURIComponent(found.slice(name.length + 1)) : null;
  }

  const zone = Intl.DateTimeFormat().resolvedOptions().timeZone;
  if (zone && cookie("automesh_tz") !== zone) {
    setCookie("automesh_tz", zone);
    // The first page was rendered before the server knew the zone.
    if (cookie("automesh_time") !== "utc" && document.getElementById("time-toggle")) {
      location.reload();
      return;
    }
  }

  document.addEventListener("DOMContentLoaded", function () {
    const toggle = document.getElementById("time-toggle");
    if (toggle) {
      toggle.addEventListener("click", function () {
        setCookie("automesh_time", toggle.dataset.mode === "utc" ? "local" : "utc");
        location.reload();
      });
    }
    scheduleForm();
    liveRun();
  });

  function scheduleForm() {
    const form = document.getElementById("automation-form");
    if (!form) return;
    const select = form.querySelector("#zone");
    if (select && select.dataset.browserZone === "true" && zone) {
      const option = Array.from(select.options).find((o) => o.value === zone);
      if (option) select.value = zone;
    }
    const preview = document.getElementById("preview");
    let timer = null;
    function kind() {
      const checked = form.querySelector("input[name=kind]:checked");
      return checked ? checked.value : "daily";
    }
    function show() {
      const k = kind();
      form.querySelectorAll(".when-once").forEach((e) => (e.hidden = k !== "once"));
      form.querySelectorAll(".when-repeating").forEach((e) => (e.hidden = k === "once"));
      form.querySelectorAll(".when-weekly").forEach((e) => (e.hidden = k !== "weekly"));
    }
    function refresh() {
      const data = new FormData(form);
      const query = new URLSearchParams();
      for (const name of ["kind", "time", "zone", "once_at"]) {
        if (data.get(name) !== null) query.append(name, data.get(name));
      }
      for (const day of data.getAll("days")) query.append("days", day);
      fetch("/preview?" + query.toString(), { credentials: "same-origin" })
        .then((r) => r.text())
        .then((html) => {
          // The server escapes everything it puts in the fragment.
          preview.innerHTML = html;
        })
        .catch(() => {
          preview.textContent = "The preview is unavailable (the console did not answer).";
        });
    }
    form.addEventListener("input", function () {
      show();
      clearTimeout(timer);
      timer = setTimeout(refresh, 250);
    });
    form.addEventListener("change", function () {
      show();
      clearTimeout(timer);
      timer = setTimeout(refresh, 50);
    });
    show();
    refresh();
  }

  function liveRun() {
    const thread = document.getElementById("thread");
    if (!thread || thread.dataset.live !== "true") return;
    const status = document.getElementById("live-status");
    const summary = document.getElementById("run-summary");
    const source = new EventSource("/runs/" + encodeURIComponent(thread.dataset.run) + "/events?after=" + thread.dataset.after);
    source.addEventListener("item", function (e) {
      const seq = Number(e.lastEventId);
      // Never show an event twice (the server resumes after the last id).
      if (thread.querySelector('li[data-seq="' + seq + '"]')) return;
      thread.insertAdjacentHTML("beforeend", e.data);
      status.textContent = "Following the run live…";
    });
    source.addEventListener("run", function (e) {
      summary.innerHTML = e.data;
    });
    source.addEventListener("end", function () {
      source.close();
      status.textContent = "The run is over.";
      thread.dataset.live = "false";
    });
    source.addEventListener("gone", function () {
      status.textContent = "Connection to the API lost; reconnecting…";
    });
    source.addEventListener("fatal", function (e) {
      source.close();
      status.textContent = e.data === "signed-out" ? "Your session ended: sign in again." : "This run can no longer be followed.";
    });
    source.onerror = function () {
      if (source.readyState !== EventSource.CLOSED) status.textContent = "Connection lost; reconnecting…";
    };
  }
})();

// A form that would start something doomed (a desktop run with no runner
// connected) asks first.
document.querySelectorAll("form[data-confirm]").forEach((form) => {
  form.addEventListener("submit", (event) => {
    if (!window.confirm(form.dataset.confirm)) event.preventDefault();
  });
});
