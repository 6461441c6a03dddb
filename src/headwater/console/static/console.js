// The console's only script: the live tail (server-sent events), one record shown whole,
// "check all" boxes and confirmations. Everything else is plain HTML forms.
"use strict";

const MAX_ROWS = 200;
let stream = null; // the EventSource of the tail being followed

function cell(row, text) {
  const td = document.createElement("td");
  td.textContent = text;
  row.appendChild(td);
  return td;
}

function showRecord(r) {
  fetch(`/live/record?topic=${encodeURIComponent(r.topic)}&partition=${r.partition}&offset=${r.offset}`, { headers: { Accept: "application/json" } })
    .then((resp) => (resp.ok ? resp.json() : Promise.reject(resp.statusText)))
    .then((rec) => {
      document.getElementById("record").hidden = false;
      document.getElementById("record-title").textContent = `${rec.topic}[${rec.partition}] @ ${rec.offset} · ${rec.time}`;
      const headers = document.getElementById("record-headers");
      headers.replaceChildren();
      for (const h of rec.headers) {
        const tr = document.createElement("tr");
        const th = document.createElement("th");
        th.textContent = h.name;
        tr.appendChild(th);
        cell(tr, h.value);
        headers.appendChild(tr);
      }
      document.getElementById("record-json").textContent = rec.json ?? "(not JSON)";
      document.getElementById("record-hex").textContent = rec.hex;
    })
    .catch((e) => { document.getElementById("record-title").textContent = `could not read the record: ${e}`; });
}

function follow(form) {
  const state = document.getElementById("tail-state");
  const body = document.querySelector("#records tbody");
  const params = new URLSearchParams(new FormData(form));
  if (stream) stream.close();
  body.replaceChildren();
  const source = new EventSource(`/live/events?${params}`);
  stream = source;
  source.addEventListener("open", () => { state.textContent = "following"; });
  source.addEventListener("error", () => { state.textContent = "reconnecting..."; });
  source.addEventListener("skipped", (e) => { state.textContent = `following (${e.data} more not shown: too many)`; });
  source.addEventListener("record", (e) => {
    const r = JSON.parse(e.data);
    const tr = document.createElement("tr");
    tr.dataset.offset = r.offset;
    cell(tr, `${r.partition}:${r.offset}`);
    cell(tr, r.type);
    cell(tr, r.source);
    cell(tr, r.protocol);
    cell(tr, r.size).className = "n";
    cell(tr, r.preview);
    tr.addEventListener("click", () => {
      body.querySelectorAll("tr.chosen").forEach((x) => x.classList.remove("chosen"));
      tr.classList.add("chosen");
      showRecord(r);
    });
    body.prepend(tr);
    while (body.children.length > MAX_ROWS) body.lastElementChild.remove();
  });
}

document.addEventListener("DOMContentLoaded", () => {
  const tail = document.getElementById("tail");
  if (tail) {
    const wanted = new URLSearchParams(location.search).get("topic");
    if (wanted && tail.topic) tail.topic.value = wanted;
    tail.addEventListener("submit", (e) => { e.preventDefault(); follow(tail); });
    if (tail.topic && tail.topic.value) follow(tail);
  }
  document.querySelectorAll("[data-check-all]").forEach((box) => {
    box.addEventListener("change", () => {
      box.form.querySelectorAll(`input[name="${box.dataset.checkAll}"]`).forEach((b) => { b.checked = box.checked; });
    });
  });
  document.querySelectorAll("form[data-confirm]").forEach((form) => {
    form.addEventListener("submit", (e) => { if (!confirm(form.dataset.confirm)) e.preventDefault(); });
  });
});
