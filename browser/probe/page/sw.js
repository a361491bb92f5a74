// The probe's service worker: fetches what the page asks it to, from the worker's own context
// (a service worker's requests are not the page's: a different code path in the browser).
self.addEventListener("install", () => self.skipWaiting());
self.addEventListener("activate", (event) => event.waitUntil(self.clients.claim()));
self.addEventListener("message", (event) => {
  const { id, url, timeout } = event.data || {};
  const port = event.ports[0];
  const timer = setTimeout(() => port.postMessage({ id, outcome: "timeout", error: null }), timeout);
  fetch(url, { mode: "no-cors", cache: "no-store", credentials: "omit" }).then(
    (response) => {
      clearTimeout(timer);
      port.postMessage({ id, outcome: "answered", error: `response type ${response.type}` });
    },
    (error) => {
      clearTimeout(timer);
      port.postMessage({ id, outcome: "failed", error: String(error) });
    },
  );
});
