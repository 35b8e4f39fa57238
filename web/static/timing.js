// prompt-broker inbox: a prompt's deadline, escalation and reminders, as its card shows them.
// Loaded before inbox.js (both deferred, in order); everything goes in through textContent.
"use strict";
window.pbTiming = (() => {
  const SOON_S = 300; // under five minutes left: the deadline is flagged

  function span(s) {
    if (s < 60) return `${s}s`;
    if (s < 3600) return `${Math.floor(s / 60)}m`;
    if (s < 86400) {
      const m = Math.floor((s % 3600) / 60);
      return `${Math.floor(s / 3600)}h${m ? ` ${m}m` : ""}`;
    }
    const hrs = Math.floor((s % 86400) / 3600);
    return `${Math.floor(s / 86400)}d${hrs ? ` ${hrs}h` : ""}`;
  }

  function secondsLeft(iso) {
    const t = Date.parse(iso);
    return Number.isNaN(t) ? null : Math.round((t - Date.now()) / 1000);
  }

  // "expires in 14m", "expires in 1h 5m", "past its deadline"
  function left(iso) {
    const s = secondsLeft(iso);
    if (s === null) return "";
    return s > 0 ? `expires in ${span(s)}` : "past its deadline";
  }

  function mark(el, iso) {
    const s = secondsLeft(iso);
    el.textContent = left(iso);
    el.classList.toggle("soon", s !== null && s <= SOON_S);
  }

  // The labels a prompt's card carries: its time left, "escalated to G", "reminded".
  function flags(h, p, reminded) {
    const out = [];
    if (p.deadline_at) {
      const t = h("time", { class: "deadline", datetime: p.deadline_at, title: `deadline ${new Date(Date.parse(p.deadline_at)).toLocaleString()}` });
      mark(t, p.deadline_at);
      out.push(t);
    }
    if (p.escalated_to) out.push(h("span", { class: "badge escalated" }, `escalated to ${p.escalated_to}`));
    if (reminded) out.push(h("span", { class: "badge reminded" }, "reminded"));
    return out;
  }

  // The same, in words, for a card's accessible name.
  function words(p, reminded) {
    return [p.deadline_at ? left(p.deadline_at) : "", p.escalated_to ? `escalated to ${p.escalated_to}` : "", reminded ? "reminded" : ""]
      .filter(Boolean)
      .map((w) => `; ${w}`)
      .join("");
  }

  function tick() {
    for (const t of document.querySelectorAll("time.deadline")) mark(t, t.getAttribute("datetime"));
  }

  return { flags, left, tick, words };
})();
