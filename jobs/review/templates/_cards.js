  // shared by the clip and ad pages (included into each page's script): the cards, the
  // operator's name kept by the browser, media loaded only near the viewport (at most about a
  // page's worth of requests on load), and j/k selection that crosses page boundaries
  const cards = Array.from(document.querySelectorAll(".card"));
  const op = document.getElementById("operator");
  op.value = localStorage.getItem("clipmill-operator") || op.value;
  op.addEventListener("change", () => localStorage.setItem("clipmill-operator", op.value));
  const lazy = new IntersectionObserver((entries) => {
    for (const e of entries) {
      if (!e.isIntersecting) continue;
      const el = e.target;
      if (el.dataset.poster) el.poster = el.dataset.poster;
      if (el.dataset.src) el.src = el.dataset.src;
      lazy.unobserve(el);
    }
  }, {rootMargin: "300px 0px"});
  document.querySelectorAll(".lazy").forEach((el) => lazy.observe(el));
  let current = 0;
  function select(i) {
    if (!cards.length) return;
    if (i >= cards.length) { const n = document.getElementById("next"); if (n) location.href = n.href + "#first"; return; }
    if (i < 0) { const p = document.getElementById("prev"); if (p) location.href = p.href + "#last"; return; }
    current = i;
    cards.forEach((c, k) => c.classList.toggle("selected", k === current));
    cards[current].scrollIntoView({block: "nearest"});
  }
