//! The guide's pictures (the data flow, the circuit's states, the hand-over between
//! runs), drawn to SVG from text sources kept beside them (`docs/pictures/*.toml`): boxes
//! at places given in the source, and labelled arrows between them, set in the plots'
//! bundled font. The test suite draws each source again and fails when the SVG beside it
//! is not what its source draws.

use std::collections::BTreeMap;

use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};
use serde::Deserialize;

use crate::plot::{register_font, PlotError, FAMILY};

/// A picture's source: its size, its boxes and the arrows between them.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Diagram {
    /// Width and height in pixels.
    pub size: (u32, u32),
    /// A line of text over the picture (none where the page's heading says it).
    #[serde(default)]
    pub title: Option<String>,
    #[serde(rename = "box", default)]
    pub boxes: Vec<DiagramBox>,
    #[serde(rename = "arrow", default)]
    pub arrows: Vec<Arrow>,
}

/// A box: its name (what arrows refer to), its lines of text, its top-left corner and
/// its size.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DiagramBox {
    pub id: String,
    pub text: Vec<String>,
    pub at: (i32, i32),
    pub size: (i32, i32),
    /// `"aws"` (orange), `"paceline"` (blue), `"state"` (grey) or `"outside"` (white).
    #[serde(default)]
    pub kind: BoxKind,
}

#[derive(Debug, Default, Deserialize, Clone, Copy)]
#[serde(rename_all = "lowercase")]
pub enum BoxKind {
    Aws,
    #[default]
    Paceline,
    State,
    Outside,
}

impl BoxKind {
    fn fill(self) -> RGBColor {
        match self {
            Self::Aws => RGBColor(255, 236, 204),
            Self::Paceline => RGBColor(214, 228, 252),
            Self::State => RGBColor(235, 235, 235),
            Self::Outside => WHITE,
        }
    }
}

/// An arrow from one box's side to another's, with a label beside its middle.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Arrow {
    pub from: String,
    pub to: String,
    #[serde(default)]
    pub label: String,
    /// Where the label goes, from the arrow's middle, in pixels (above it unless set).
    #[serde(default)]
    pub label_offset: Option<(i32, i32)>,
    /// Points the arrow passes through between the boxes, for one that goes round.
    #[serde(default)]
    pub via: Vec<(i32, i32)>,
}

const LINE_HEIGHT: i32 = 17;
const TEXT_SIZE: f64 = 17.0;
const ARROW_HEAD: f64 = 9.0;
const INK: RGBColor = RGBColor(40, 40, 40);

impl Diagram {
    /// Reads a picture's source.
    ///
    /// # Errors
    /// The TOML's error, naming what is wrong.
    pub fn from_toml(source: &str) -> Result<Self, PlotError> {
        toml::from_str(source).map_err(|e| PlotError(format!("a picture's source: {e}")))
    }

    /// The picture as SVG.
    ///
    /// # Errors
    /// An arrow naming a box that is not there, or drawing that failed.
    pub fn to_svg(&self) -> Result<String, PlotError> {
        register_font()?;
        let boxes: BTreeMap<&str, &DiagramBox> = self.boxes.iter().map(|b| (b.id.as_str(), b)).collect();
        for arrow in &self.arrows {
            for end in [&arrow.from, &arrow.to] {
                if !boxes.contains_key(end.as_str()) {
                    return Err(PlotError(format!("an arrow names box {end:?}, which the picture does not have")));
                }
            }
        }
        let mut svg = String::new();
        {
            let root = SVGBackend::with_string(&mut svg, self.size).into_drawing_area();
            self.draw(&root, &boxes).map_err(|e| PlotError(format!("drawing a picture: {e}")))?;
            root.present().map_err(|e| PlotError(format!("drawing a picture: {e}")))?;
        }
        Ok(svg)
    }

    fn draw<DB: DrawingBackend>(
        &self,
        root: &DrawingArea<DB, plotters::coord::Shift>,
        boxes: &BTreeMap<&str, &DiagramBox>,
    ) -> Result<(), Box<dyn std::error::Error>>
    where
        DB::ErrorType: 'static,
    {
        root.fill(&WHITE)?;
        let font = (FAMILY, TEXT_SIZE).into_font().color(&INK);
        if let Some(title) = &self.title {
            root.draw(&Text::new(title.as_str(), (12, 8), (FAMILY, 20.0).into_font().color(&INK)))?;
        }
        for b in &self.boxes {
            let (x, y, w, h) = (b.at.0, b.at.1, b.size.0, b.size.1);
            root.draw(&Rectangle::new([(x, y), (x + w, y + h)], b.kind.fill().filled()))?;
            root.draw(&Rectangle::new([(x, y), (x + w, y + h)], INK.stroke_width(1)))?;
            let first = y + h / 2 - (LINE_HEIGHT * (b.text.len() as i32 - 1)) / 2;
            for (index, line) in b.text.iter().enumerate() {
                let centred = font.clone().pos(Pos::new(HPos::Center, VPos::Center));
                root.draw(&Text::new(line.as_str(), (x + w / 2, first + LINE_HEIGHT * index as i32), centred))?;
            }
        }
        for arrow in &self.arrows {
            let (from, to) = (boxes[arrow.from.as_str()], boxes[arrow.to.as_str()]);
            let first_toward = arrow.via.first().copied().unwrap_or_else(|| centre(to));
            let last_from = arrow.via.last().copied().unwrap_or_else(|| centre(from));
            let mut points = vec![edge_toward(from, first_toward)];
            points.extend(arrow.via.iter().copied());
            points.push(edge_toward(to, last_from));
            root.draw(&PathElement::new(points.clone(), INK.stroke_width(2)))?;
            let (tip, before) = (points[points.len() - 1], points[points.len() - 2]);
            root.draw(&Polygon::new(arrow_head(before, tip), INK.filled()))?;
            if !arrow.label.is_empty() {
                let middle = (points[points.len() / 2 - 1 + points.len() % 2], points[points.len() / 2]);
                let (mx, my) = ((middle.0 .0 + middle.1 .0) / 2, (middle.0 .1 + middle.1 .1) / 2);
                let (dx, dy) = arrow.label_offset.unwrap_or((0, -12));
                let centred = font.clone().pos(Pos::new(HPos::Center, VPos::Center));
                for (index, line) in arrow.label.lines().enumerate() {
                    root.draw(&Text::new(line, (mx + dx, my + dy + LINE_HEIGHT * index as i32), centred.clone()))?;
                }
            }
        }
        Ok(())
    }
}

fn centre(b: &DiagramBox) -> (i32, i32) {
    (b.at.0 + b.size.0 / 2, b.at.1 + b.size.1 / 2)
}

/// Where a line from `b`'s centre toward `point` leaves `b`'s edge.
fn edge_toward(b: &DiagramBox, point: (i32, i32)) -> (i32, i32) {
    let (cx, cy) = centre(b);
    let (dx, dy) = (f64::from(point.0 - cx), f64::from(point.1 - cy));
    if dx == 0.0 && dy == 0.0 {
        return (cx, cy);
    }
    let (half_w, half_h) = (f64::from(b.size.0) / 2.0, f64::from(b.size.1) / 2.0);
    let scale = (half_w / dx.abs()).min(half_h / dy.abs());
    (cx + (dx * scale).round() as i32, cy + (dy * scale).round() as i32)
}

/// The triangle at `tip` of a line coming from `from`.
fn arrow_head(from: (i32, i32), tip: (i32, i32)) -> Vec<(i32, i32)> {
    let (dx, dy) = (f64::from(tip.0 - from.0), f64::from(tip.1 - from.1));
    let length = dx.hypot(dy).max(1.0);
    let (ux, uy) = (dx / length, dy / length);
    let back = (f64::from(tip.0) - ux * ARROW_HEAD * 1.6, f64::from(tip.1) - uy * ARROW_HEAD * 1.6);
    let side = (-uy * ARROW_HEAD * 0.6, ux * ARROW_HEAD * 0.6);
    vec![tip, ((back.0 + side.0).round() as i32, (back.1 + side.1).round() as i32), ((back.0 - side.0).round() as i32, (back.1 - side.1).round() as i32)]
}

#[cfg(test)]
mod tests {
    use super::*;

    const TWO_BOXES: &str = r#"
size = [300, 100]
[[box]]
id = "a"
text = ["A <b> & c"]
at = [10, 10]
size = [80, 40]
[[box]]
id = "b"
text = ["B"]
at = [200, 10]
size = [80, 40]
[[arrow]]
from = "a"
to = "b"
label = "sends"
"#;

    #[test]
    fn a_picture_draws_its_boxes_text_as_text_and_its_arrows() {
        let svg = Diagram::from_toml(TWO_BOXES).unwrap().to_svg().unwrap();
        assert!(svg.starts_with("<svg"), "{svg}");
        assert!(svg.contains("A &lt;b&gt; &amp; c"), "a box's text is escaped: {svg}");
        assert!(svg.contains("\nsends\n"), "an arrow's label: {svg}");
        assert_eq!(svg.matches("<polygon").count(), 1, "one arrow head: {svg}");
    }

    #[test]
    fn an_arrow_to_a_box_the_picture_lacks_is_named() {
        let source = TWO_BOXES.replace("to = \"b\"", "to = \"c\"");
        let error = Diagram::from_toml(&source).unwrap().to_svg().unwrap_err();
        assert!(error.to_string().contains("\"c\""), "{error}");
    }

    #[test]
    fn an_arrow_leaves_a_box_at_its_edge_toward_the_other() {
        let b = DiagramBox { id: "a".into(), text: vec![], at: (0, 0), size: (100, 40), kind: BoxKind::Paceline };
        assert_eq!(edge_toward(&b, (300, 20)), (100, 20));
        assert_eq!(edge_toward(&b, (50, 200)), (50, 40));
    }
}
