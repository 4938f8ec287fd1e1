// Small SVG charts drawn in the browser: lines (with an optional band) and a histogram.
// Each draw replaces the SVG's content and sets `data-points` to the points drawn.

const NS = "http://www.w3.org/2000/svg";
export const PALETTE = [
  "#2563eb", "#dc2626", "#16a34a", "#9333ea", "#ea580c", "#0891b2", "#ca8a04", "#db2777",
  "#4b5563", "#65a30d", "#7c3aed", "#0d9488", "#b91c1c", "#1d4ed8", "#a16207", "#be185d",
  "#15803d", "#6d28d9", "#c2410c", "#0e7490",
];
const MARGIN = { top: 12, right: 16, bottom: 38, left: 56 };
const MAX_POINTS = 600; // per series: longer ones are thinned to this for drawing

function size(svg) {
  const box = svg.viewBox.baseVal;
  return box && box.width ? [box.width, box.height] : [640, 260];
}

function ticks(low, high, count) {
  if (!(high > low)) return [low];
  const raw = (high - low) / count;
  const magnitude = 10 ** Math.floor(Math.log10(raw));
  const step = [1, 2, 5, 10].map((m) => m * magnitude).find((s) => s >= raw) || raw;
  const out = [];
  for (let v = Math.ceil(low / step) * step; v <= high + step * 1e-9; v += step) out.push(v);
  return out;
}

function label(value) {
  if (Math.abs(value) >= 1000) return value.toLocaleString("en", { maximumFractionDigits: 0 });
  return Number(value.toPrecision(4)).toString();
}

function thin(points) {
  if (points.length <= MAX_POINTS) return points;
  const stride = points.length / MAX_POINTS;
  const out = [];
  for (let i = 0; i < MAX_POINTS; i++) out.push(points[Math.floor(i * stride)]);
  out.push(points[points.length - 1]);
  return out;
}

function escape(text) {
  return String(text).replace(/[&<>"]/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;" })[c]);
}

function empty(svg, message) {
  const [width, height] = size(svg);
  svg.innerHTML = `<text x="${width / 2}" y="${height / 2}" class="empty" text-anchor="middle">${escape(message)}</text>`;
  svg.dataset.points = "0";
}

function frame(svg, xs, ys, xLabel, yLabel, xFormat = label, top = MARGIN.top) {
  const [width, height] = size(svg);
  const plotW = width - MARGIN.left - MARGIN.right;
  const plotH = height - top - MARGIN.bottom;
  const [x0, x1] = xs[0] === xs[1] ? [xs[0] - 1, xs[1] + 1] : xs;
  const [y0, y1] = ys[0] === ys[1] ? [ys[0] - 1, ys[1] + 1] : ys;
  const sx = (x) => MARGIN.left + ((x - x0) / (x1 - x0)) * plotW;
  const sy = (y) => top + plotH - ((y - y0) / (y1 - y0)) * plotH;
  const parts = [];
  for (const t of ticks(y0, y1, 5)) {
    parts.push(`<line class="grid" x1="${MARGIN.left}" x2="${width - MARGIN.right}" y1="${sy(t)}" y2="${sy(t)}"/>`);
    parts.push(`<text class="tick" x="${MARGIN.left - 6}" y="${sy(t) + 4}" text-anchor="end">${label(t)}</text>`);
  }
  for (const t of ticks(x0, x1, 6)) {
    parts.push(`<text class="tick" x="${sx(t)}" y="${height - MARGIN.bottom + 16}" text-anchor="middle">${escape(xFormat(t))}</text>`);
  }
  parts.push(`<line class="axis" x1="${MARGIN.left}" x2="${width - MARGIN.right}" y1="${top + plotH}" y2="${top + plotH}"/>`);
  parts.push(`<text class="axis-label" x="${MARGIN.left + plotW / 2}" y="${height - 4}" text-anchor="middle">${escape(xLabel)}</text>`);
  parts.push(`<text class="axis-label" transform="translate(14 ${top + plotH / 2}) rotate(-90)" text-anchor="middle">${escape(yLabel)}</text>`);
  return { parts, sx, sy, width };
}

// series: [{name, points: [[x, y], ...], color?, dashed?}]; band: {points: [[x, low, high]], name};
// zero: the y axis starts at 0 (else at the data's lowest value).
export function lineChart(svg, { series, xLabel, yLabel, band = null, xFormat, zero = false, integerX = false, emptyText = "no data yet" }) {
  const drawn = series.filter((s) => s.points.length);
  const total = drawn.reduce((n, s) => n + s.points.length, 0);
  if (!total) return empty(svg, emptyText);
  const all = drawn.flatMap((s) => s.points);
  const bandPoints = band ? band.points : [];
  const xs = [Math.min(...all.map((p) => p[0])), Math.max(...all.map((p) => p[0]))];
  const ysAll = all.map((p) => p[1]).concat(bandPoints.flatMap((p) => [p[1], p[2]]));
  const ys = [zero ? Math.min(0, ...ysAll) : Math.min(...ysAll), Math.max(...ysAll)];
  const legend = drawn.map((s, i) => [s.name, s.color || PALETTE[i % PALETTE.length]]);
  if (band && band.name) legend.push([band.name, "band"]);
  const [width] = size(svg);
  const placed = []; // [name, color, x, row]: left to right, wrapping, above the plot
  let x = MARGIN.left;
  let row = 0;
  for (const [name, color] of legend) {
    const room = 26 + name.length * 6.2;
    if (x + room > width - MARGIN.right && x > MARGIN.left) {
      x = MARGIN.left;
      row += 1;
    }
    placed.push([name, color, x, row]);
    x += room;
  }
  const top = MARGIN.top + (placed.length ? (row + 1) * 15 : 0);
  const format = integerX ? (v) => (Number.isInteger(v) ? label(v) : "") : xFormat;
  const { parts, sx, sy } = frame(svg, xs, ys, xLabel, yLabel, format, top);
  if (bandPoints.length > 1) {
    const thinned = thin(bandPoints);
    const upper = thinned.map((p) => `${sx(p[0]).toFixed(1)},${sy(p[2]).toFixed(1)}`);
    const lower = thinned.map((p) => `${sx(p[0]).toFixed(1)},${sy(p[1]).toFixed(1)}`).reverse();
    parts.push(`<polygon class="band" points="${upper.concat(lower).join(" ")}"/>`);
    parts.push(`<polyline class="band-edge" points="${upper.join(" ")}"/>`);
  }
  drawn.forEach((s, i) => {
    const color = s.color || PALETTE[i % PALETTE.length];
    const points = thin(s.points).map((p) => `${sx(p[0]).toFixed(1)},${sy(p[1]).toFixed(1)}`).join(" ");
    parts.push(`<polyline class="line${s.dashed ? " dashed" : ""}" stroke="${color}" points="${points}"/>`);
  });
  for (const [name, color, lx, lrow] of placed) {
    const y = 10 + lrow * 15;
    const mark = color === "band"
      ? `<rect class="band" x="${lx}" y="${y - 8}" width="14" height="9"/>`
      : `<rect x="${lx}" y="${y - 5}" width="14" height="3" fill="${color}"/>`;
    parts.push(`${mark}<text class="legend" x="${lx + 18}" y="${y}">${escape(name)}</text>`);
  }
  svg.innerHTML = parts.join("");
  svg.dataset.points = String(total);
}

// bins: [[label, count], ...] in order
export function histogram(svg, { bins, xLabel, yLabel, emptyText = "no data yet" }) {
  const total = bins.reduce((n, b) => n + b[1], 0);
  if (!total) return empty(svg, emptyText);
  const [width, height] = size(svg);
  const top = Math.max(...bins.map((b) => b[1]));
  const { parts, sy } = frame(svg, [0, bins.length], [0, top], xLabel, yLabel, () => "");
  const plotW = width - MARGIN.left - MARGIN.right;
  const slot = plotW / bins.length;
  bins.forEach(([name, count], i) => {
    const x = MARGIN.left + i * slot + slot * 0.1;
    parts.push(`<rect class="hist-bar" x="${x.toFixed(1)}" y="${sy(count).toFixed(1)}" width="${(slot * 0.8).toFixed(1)}" height="${(sy(0) - sy(count)).toFixed(1)}"><title>${escape(name)}: ${count}</title></rect>`);
    if (bins.length <= 24 || i % Math.ceil(bins.length / 24) === 0) {
      parts.push(`<text class="tick" x="${(x + slot * 0.4).toFixed(1)}" y="${height - MARGIN.bottom + 16}" text-anchor="middle">${escape(name)}</text>`);
    }
  });
  svg.innerHTML = parts.join("");
  svg.dataset.points = String(bins.filter((b) => b[1]).length);
}

export function makeSvg(id, width = 640, height = 260) {
  const svg = document.createElementNS(NS, "svg");
  svg.id = id;
  svg.setAttribute("viewBox", `0 0 ${width} ${height}`);
  svg.setAttribute("class", "chart");
  svg.dataset.points = "0";
  return svg;
}
