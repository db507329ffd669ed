//! Tables for the terminal, as every report of the `paceline` command and the
//! simulator prints them: no borders, a rule under the header, numbers aligned right,
//! fitted to the terminal's width.

use comfy_table::{CellAlignment, ContentArrangement, Row, Table};

/// A table style with no borders, and a rule under the header (comfy-table's preset
/// layout: borders, then the header line and its crossings, then the rest).
const HEADER_RULE_ONLY: &str = "     ──            ";

/// A table for the terminal: `header`, the columns numbered in `right_aligned` aligned
/// right, fitted to the terminal's width (wrapping at words; [`one_line_row`] cuts with
/// an ellipsis instead).
#[must_use]
pub fn text_table(header: &[&str], right_aligned: &[usize]) -> Table {
    let mut table = Table::new();
    table.load_preset(HEADER_RULE_ONLY).set_content_arrangement(ContentArrangement::Dynamic).set_truncation_indicator("…").set_header(header.to_vec());
    for index in right_aligned {
        if let Some(column) = table.column_mut(*index) {
            column.set_cell_alignment(CellAlignment::Right);
        }
    }
    table
}

/// A row for [`text_table`] that stays on one line: text too long for the terminal is
/// cut with an ellipsis rather than wrapped.
#[must_use]
pub fn one_line_row(cells: Vec<String>) -> Row {
    let mut row = Row::from(cells);
    row.max_height(1);
    row
}
