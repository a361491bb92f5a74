// egresswall containment probe: tries every escape route listed in its targets and reports each
// attempt as {route, target, outcome, error}.
//
// Page-level outcomes (the runner, browser/probe/runner.py, turns them into the final ones with what
// the browser's network events showed):
//   answered  the page saw an answer (fetch resolved, image/script/style loaded, WebSocket opened,
//             a STUN server's reflexive candidate);
//   failed    the page saw an error (and no answer);
//   sent      fired, but the page cannot observe the result (beacon, form, iframe, popup, hints);
//   timeout   nothing within the time limit;
//   error     the route could not be tried here (API missing, bad target).
// Navigation and redirect routes are the runner's: a navigation would take this page away.
"use strict";

(function () {
  const PAGE_ROUTES = {
    fetch: probeFetch,
    websocket: probeWebSocket,
    img: (url) => probeElement("img", url),
    script: (url) => probeElement("script", url),
    css: (url) => probeElement("css", url),
    iframe: probeIframe,
    beacon: probeBeacon,
    "form-post": probeFormPost,
    popup: probePopup,
    "service-worker-fetch": probeServiceWorker,
    "dns-prefetch": (url) => probeHint("dns-prefetch", url),
    preconnect: (url) => probeHint("preconnect", url),
    "webrtc-stun": probeStun,
  };
  const RUNNER_ROUTES = ["navigation", "redirect"];
  const state = (window.__egresswallProbe = window.__egresswallProbe || {});
  const scratch = () => document.getElementById("scratch") || document.body;
  let counter = 0;
  const popups = [];

  function result(outcome, error) {
    return { outcome, error: error === undefined || error === null ? null : String(error) };
  }

  function withTimeout(promise, ms) {
    let timer;
    const timeout = new Promise((resolve) => {
      timer = setTimeout(() => resolve(result("timeout", `nothing within ${ms} ms`)), ms);
    });
    return Promise.race([promise, timeout]).finally(() => clearTimeout(timer));
  }

  function probeFetch(url) {
    return fetch(url, { mode: "no-cors", cache: "no-store", credentials: "omit", redirect: "follow" }).then(
      (response) => result("answered", `response type ${response.type}`),
      (error) => result("failed", error),
    );
  }

  function probeWebSocket(url) {
    return new Promise((resolve) => {
      let socket;
      try {
        socket = new WebSocket(url);
      } catch (error) {
        resolve(result("error", error));
        return;
      }
      let opened = false;
      socket.onopen = () => {
        opened = true;
        socket.close();
        resolve(result("answered", "WebSocket opened"));
      };
      socket.onerror = () => {};
      socket.onclose = (event) => {
        if (!opened) resolve(result("failed", `closed before opening (code ${event.code})`));
      };
    });
  }

  function probeElement(kind, url) {
    return new Promise((resolve) => {
      let element;
      if (kind === "img") {
        element = new Image();
        element.src = url;
      } else if (kind === "script") {
        element = document.createElement("script");
        element.src = url;
      } else {
        element = document.createElement("link");
        element.rel = "stylesheet";
        element.href = url;
      }
      element.onload = () => resolve(result("answered", `${kind} loaded`));
      element.onerror = () => resolve(result("failed", `${kind} did not load`));
      if (kind !== "img") scratch().appendChild(element);
    });
  }

  function probeIframe(url) {
    return new Promise((resolve) => {
      const frame = document.createElement("iframe");
      frame.onload = () => resolve(result("sent", "iframe load event (fires for error pages too)"));
      frame.src = url;
      scratch().appendChild(frame);
    });
  }

  function probeBeacon(url) {
    const queued = navigator.sendBeacon(url, "egresswall-probe");
    return Promise.resolve(queued ? result("sent", "beacon queued") : result("failed", "sendBeacon refused to queue"));
  }

  function probeFormPost(url) {
    return new Promise((resolve) => {
      const name = `probe-form-${++counter}`;
      const frame = document.createElement("iframe");
      frame.name = name;
      const form = document.createElement("form");
      form.method = "POST";
      form.action = url;
      form.target = name;
      const input = document.createElement("input");
      input.name = "probe";
      input.value = "egresswall";
      form.appendChild(input);
      scratch().appendChild(frame);
      scratch().appendChild(form);
      frame.onload = () => resolve(result("sent", "form submitted (the frame loaded a page or an error page)"));
      form.submit();
    });
  }

  function probePopup(url) {
    const popup = window.open(url, "_blank");
    if (!popup) return Promise.resolve(result("failed", "window.open returned null (popup blocked)"));
    popups.push(popup);
    return new Promise((resolve) => setTimeout(() => resolve(result("sent", "popup opened")), 500));
  }

  let registration = null;
  function serviceWorker() {
    if (!("serviceWorker" in navigator)) return Promise.reject(new Error("no service workers here (needs a secure context)"));
    if (!registration) {
      registration = navigator.serviceWorker
        .register("sw.js", { scope: "./" })
        .then(() => navigator.serviceWorker.ready)
        .then((ready) => ready.active);
    }
    return registration;
  }

  function probeServiceWorker(url, timeout) {
    return serviceWorker().then(
      (worker) =>
        new Promise((resolve) => {
          const channel = new MessageChannel();
          channel.port1.onmessage = (event) => resolve(result(event.data.outcome, event.data.error));
          worker.postMessage({ id: ++counter, url, timeout: Math.max(500, timeout - 500) }, [channel.port2]);
        }),
      (error) => result("error", error),
    );
  }

  function probeHint(rel, url) {
    const link = document.createElement("link");
    link.rel = rel;
    link.href = url;
    document.head.appendChild(link);
    return new Promise((resolve) => setTimeout(() => resolve(result("sent", `${rel} hint inserted`)), 300));
  }

  function probeStun(url, timeout) {
    return new Promise((resolve) => {
      let pc;
      try {
        pc = new RTCPeerConnection({ iceServers: [{ urls: url }] });
      } catch (error) {
        resolve(result("error", error));
        return;
      }
      const kinds = [];
      const errors = [];
      const finish = () => {
        pc.close();
        if (kinds.includes("srflx")) resolve(result("answered", `server-reflexive candidate (candidates: ${kinds.join(",")})`));
        else if (errors.length) resolve(result("failed", `ICE errors: ${errors.join("; ")} (candidates: ${kinds.join(",") || "none"})`));
        else resolve(result("failed", `no answer from the STUN server (candidates: ${kinds.join(",") || "none"})`));
      };
      pc.onicecandidate = (event) => {
        if (!event.candidate) return finish();
        kinds.push(event.candidate.type || "?");
      };
      pc.onicecandidateerror = (event) => errors.push(`${event.errorCode} ${event.errorText || ""}`.trim());
      pc.createDataChannel("probe");
      pc.createOffer()
        .then((offer) => pc.setLocalDescription(offer))
        .catch((error) => resolve(result("error", error)));
      setTimeout(finish, Math.max(500, timeout - 500));
    });
  }

  async function runAll(targets, timeout, concurrency) {
    const attempts = [];
    for (const [route, list] of Object.entries(targets)) {
      if (RUNNER_ROUTES.includes(route)) continue;
      for (const target of list) attempts.push({ route, target });
    }
    const results = [];
    let next = 0;
    async function worker() {
      while (next < attempts.length) {
        const { route, target } = attempts[next++];
        const probe = PAGE_ROUTES[route];
        let outcome;
        if (!probe) outcome = result("error", `unknown route ${route}`);
        else {
          try {
            outcome = await withTimeout(Promise.resolve(probe(target, timeout)), timeout);
          } catch (error) {
            outcome = result("error", error);
          }
        }
        const row = { route, target, outcome: outcome.outcome, error: outcome.error };
        results.push(row);
        render(row);
      }
    }
    await Promise.all(Array.from({ length: concurrency }, worker));
    for (const popup of popups) {
      try {
        popup.close();
      } catch (_) {
        /* already gone */
      }
    }
    return results;
  }

  function render(row) {
    const body = document.querySelector("#results tbody");
    if (!body) return;
    const tr = document.createElement("tr");
    for (const value of [row.route, row.target, row.outcome, row.error || ""]) {
      const td = document.createElement("td");
      td.textContent = value;
      tr.appendChild(td);
    }
    if (row.outcome === "answered") tr.className = "reached";
    body.appendChild(tr);
  }

  async function main() {
    let targets = state.targets;
    if (!targets) {
      const response = await fetch("targets.json", { cache: "no-store" });
      targets = await response.json();
    }
    const timeout = state.timeout || 8000;
    state.results = await runAll(targets, timeout, state.concurrency || 6);
    state.done = true;
    const status = document.getElementById("status");
    if (status) status.textContent = `done: ${state.results.length} attempts`;
  }

  main().catch((error) => {
    state.error = String(error);
    state.done = true;
  });
})();
