// A small line plot on a <canvas>: time on x (seconds before now), one or more series on y.
// drawPlot(canvas, series, {windowS, now, unit, log, minMax}); series: [{label, color, points: [[unixSeconds, valueOrNull], ...]}].
// A null value breaks its line. Sets canvas.dataset.points to the number of values drawn (for tests and humans).
"use strict";

function niceStep(range, ticks) {
  const raw = range / Math.max(ticks, 1);
  const mag = Math.pow(10, Math.floor(Math.log10(raw)));
  for (const m of [1, 2, 2.5, 5, 10]) {
    if (m * mag >= raw) return m * mag;
  }
  return 10 * mag;
}

function formatValue(v) {
  if (v === 0) return "0";
  const a = Math.abs(v);
  if (a >= 1000) return (v / 1000).toFixed(a >= 10000 ? 0 : 1).replace(/\.0$/, "") + "k";
  if (a >= 10) return v.toFixed(0);
  if (a >= 1) return v.toFixed(1).replace(/\.0$/, "");
  return String(Number(v.toPrecision(2)));
}

function drawPlot(canvas, series, opts) {
  const dpr = window.devicePixelRatio || 1;
  const cssW = canvas.clientWidth || 480;
  const cssH = canvas.clientHeight || 200;
  if (canvas.width !== Math.round(cssW * dpr) || canvas.height !== Math.round(cssH * dpr)) {
    canvas.width = Math.round(cssW * dpr);
    canvas.height = Math.round(cssH * dpr);
  }
  const ctx = canvas.getContext("2d");
  ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
  ctx.clearRect(0, 0, cssW, cssH);

  const pad = { left: 48, right: 10, top: 10, bottom: 24 };
  const w = cssW - pad.left - pad.right;
  const h = cssH - pad.top - pad.bottom;
  const now = opts.now;
  const windowS = opts.windowS;

  let maxV = 0;
  let minPos = Infinity;
  let drawn = 0;
  for (const s of series) {
    for (const [, v] of s.points) {
      if (v !== null && v !== undefined && isFinite(v)) {
        maxV = Math.max(maxV, v);
        if (v > 0) minPos = Math.min(minPos, v);
      }
    }
  }
  // the y scale: linear from 0, or (opts.log) powers of ten around the positive values
  let y;
  let ticks = [];
  if (opts.log) {
    const lo = isFinite(minPos) ? Math.floor(Math.log10(minPos)) : 0;
    const hi = Math.max(lo + 1, maxV > 0 ? Math.ceil(Math.log10(maxV)) : 1);
    y = (v) => pad.top + h * (1 - (Math.log10(v) - lo) / (hi - lo));
    for (let e = lo; e <= hi; e++) ticks.push(Math.pow(10, e));
  } else {
    if (maxV <= 0) maxV = opts.minMax || 1;
    const step = niceStep(maxV, 4);
    const top = Math.ceil(maxV / step) * step;
    y = (v) => pad.top + h * (1 - v / top);
    for (let v = 0; v <= top + step / 2; v += step) ticks.push(v);
  }
  const x = (t) => pad.left + w * (1 - (now - t) / windowS);

  // grid and y labels
  ctx.font = "11px system-ui, sans-serif";
  ctx.fillStyle = "#6b7280";
  ctx.strokeStyle = "#e5e7eb";
  ctx.lineWidth = 1;
  ctx.textAlign = "right";
  ctx.textBaseline = "middle";
  for (const v of ticks) {
    const yy = Math.round(y(v)) + 0.5;
    ctx.beginPath();
    ctx.moveTo(pad.left, yy);
    ctx.lineTo(pad.left + w, yy);
    ctx.stroke();
    ctx.fillText(formatValue(v) + (opts.unit || ""), pad.left - 6, yy);
  }
  // x labels: seconds before now
  ctx.textAlign = "center";
  ctx.textBaseline = "top";
  const xStep = [5, 10, 15, 30, 60, 120, 300, 600].find((s) => windowS / s <= 6) || 600;
  for (let ago = 0; ago <= windowS; ago += xStep) {
    const label = ago === 0 ? "now" : xStep >= 60 ? `-${ago / 60}m` : `-${ago}s`;
    ctx.fillText(label, x(now - ago), pad.top + h + 6);
  }
  ctx.strokeStyle = "#9ca3af";
  ctx.beginPath();
  ctx.moveTo(pad.left + 0.5, pad.top);
  ctx.lineTo(pad.left + 0.5, pad.top + h + 0.5);
  ctx.lineTo(pad.left + w, pad.top + h + 0.5);
  ctx.stroke();

  // series
  ctx.save();
  ctx.beginPath();
  ctx.rect(pad.left, pad.top - 2, w, h + 4);
  ctx.clip();
  for (const s of series) {
    ctx.strokeStyle = s.color;
    ctx.fillStyle = s.color;
    ctx.lineWidth = 2;
    ctx.lineJoin = "round";
    ctx.beginPath();
    let open = false;
    let single = null;
    for (const [t, v] of s.points) {
      if (v === null || v === undefined || !isFinite(v) || now - t > windowS || (opts.log && v <= 0)) {
        open = false;
        continue;
      }
      drawn += 1;
      if (open) {
        ctx.lineTo(x(t), y(v));
        single = null;
      } else {
        ctx.moveTo(x(t), y(v));
        single = [x(t), y(v)];
        open = true;
      }
    }
    ctx.stroke();
    if (single) {  // a lone point has no line: mark it
      ctx.beginPath();
      ctx.arc(single[0], single[1], 2.5, 0, 2 * Math.PI);
      ctx.fill();
    }
  }
  ctx.restore();
  canvas.dataset.points = String(drawn);
}

window.drawPlot = drawPlot;
