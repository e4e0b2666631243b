// Each cell of a table gets its column's header as `data-label`, which extra.css shows before the cell on a phone,
// where a table is a list of cards, one per row.
document.addEventListener("DOMContentLoaded", () => {
  for (const table of document.querySelectorAll(".md-typeset table:not([class])")) {
    const headers = [...table.querySelectorAll("thead th")].map(th => th.textContent.trim());
    for (const row of table.querySelectorAll("tbody tr")) {
      [...row.children].forEach((cell, i) => {
        if (headers[i]) cell.dataset.label = headers[i];
      });
    }
  }
});
