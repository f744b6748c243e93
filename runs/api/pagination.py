"""Page-number pagination that refuses a page it cannot read: ``?page=``
must be a positive integer (400 otherwise, where DRF would answer 404 or,
for ``last``, a page); a page past the end is 404."""

from rest_framework.exceptions import ValidationError
from rest_framework.pagination import PageNumberPagination

MAX_PAGE_DIGITS = 9


class StrictPageNumberPagination(PageNumberPagination):
    last_page_strings = ()

    def get_page_number(self, request, paginator):
        raw = request.query_params.get(self.page_query_param)
        if raw is None:
            return 1
        if not (raw.isascii() and raw.isdigit() and len(raw) <= MAX_PAGE_DIGITS and int(raw) >= 1):
            raise ValidationError({self.page_query_param: ["must be a positive integer"]})
        return int(raw)

    def get_schema_operation_parameters(self, view):
        parameters = super().get_schema_operation_parameters(view)
        for parameter in parameters:
            if parameter["name"] == self.page_query_param:
                parameter["schema"] = {"type": "integer", "minimum": 1, "maximum": 10**MAX_PAGE_DIGITS - 1}
        return parameters
